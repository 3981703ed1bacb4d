// Received priority-lane messages and write notifications, waiting for poll_messages().
// Bounded in bytes: a peer whose next message would not fit waits, so a flood stalls
// that peer's control connection instead of this process's memory. Each entry counts its
// payload and sender plus kEntryOverhead, so empty messages fill the inbox too.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

namespace pddcore::transfer {

// A received priority-lane message or write notification.
struct InboxEntry {
  std::string sender;        // the sender engine's listen address (reachable: a wildcard host is
                             // replaced by the address the connection came from)
  uint64_t sender_engine_id; // from its hello, which the token's HMAC covers
  std::string payload;
  bool notification;         // the notify of a write whose every byte was applied, not a message
};

class Inbox {
 public:
  // What an entry costs beyond its payload and sender address: the entry itself, its
  // strings' allocations and the deque's share (around a hundred bytes); rounded up.
  static constexpr uint64_t kEntryOverhead = 256;

  explicit Inbox(uint64_t max_bytes) : max_bytes_(max_bytes) {}

  // Waits for room (one entry always fits an empty inbox); false once closed.
  bool push(InboxEntry entry);
  // Everything received since the last call, in arrival order; waits up to timeout_s
  // (0: not at all) for the first entry when there is none.
  std::vector<InboxEntry> poll(double timeout_s);
  // Wakes every waiter; push() refuses from now on.
  void close();

 private:
  const uint64_t max_bytes_;
  std::mutex mutex_;
  std::condition_variable arrived_;  // an entry arrived (or closed)
  std::condition_variable room_;     // poll() made room (or closed)
  std::deque<InboxEntry> entries_;
  uint64_t bytes_ = 0;
  bool closed_ = false;
};

}  // namespace pddcore::transfer
