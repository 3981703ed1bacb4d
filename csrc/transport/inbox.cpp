#include "inbox.h"

#include <chrono>
#include <iterator>

namespace pddcore::transfer {

bool Inbox::push(InboxEntry entry) {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t cost = entry.payload.size() + entry.sender.size() + kEntryOverhead;
    room_.wait(lock, [&] { return closed_ || entries_.empty() || bytes_ + cost <= max_bytes_; });
    if (closed_) return false;
    bytes_ += cost;
    entries_.push_back(std::move(entry));
  }
  arrived_.notify_all();
  return true;
}

std::vector<InboxEntry> Inbox::poll(double timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout_s > 0)
    arrived_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return !entries_.empty() || closed_; });
  std::vector<InboxEntry> out(std::make_move_iterator(entries_.begin()), std::make_move_iterator(entries_.end()));
  entries_.clear();
  bytes_ = 0;
  lock.unlock();
  room_.notify_all();
  return out;
}

void Inbox::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
  }
  arrived_.notify_all();
  room_.notify_all();
}

}  // namespace pddcore::transfer
