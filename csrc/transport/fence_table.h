// The receiver's side of cancel fences. A sender that cancels a transfer asks the
// receiver to fence (sender engine, transfer tag): chunks of a fenced transfer are dropped
// from then on, and the fence is confirmed only once no chunk of it is being written, so
// the sender may reuse the destination at once. A chunk still being written when the wait
// ends keeps the fence unconfirmed: the sender must ask again.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <utility>

namespace pddcore::transfer {

class FenceTable {
 public:
  // Fences the transfer, then waits (up to timeout_s) until none of its chunks is being
  // written. True: none is, and none will be; false: one still was when timeout_s passed or
  // the table closed.
  bool install(uint64_t sender_engine_id, uint32_t transfer_tag, double timeout_s);
  // A chunk is about to be written; false: its transfer is fenced, drop the chunk.
  bool begin(uint64_t sender_engine_id, uint32_t transfer_tag);
  // The chunk that begin() admitted is written.
  void end(uint64_t sender_engine_id, uint32_t transfer_tag);
  void close();

 private:
  using Key = std::pair<uint64_t, uint32_t>;
  // The oldest fences are forgotten beyond this: a fenced transfer's chunks arrive within moments.
  static constexpr size_t kMaxFences = 1 << 16;

  std::mutex mutex_;
  std::condition_variable written_;
  std::map<Key, int> receiving_;  // chunks being written now
  std::set<Key> fenced_;
  std::deque<Key> order_;
  bool closed_ = false;
};

}  // namespace pddcore::transfer
