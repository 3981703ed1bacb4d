#include "fence_table.h"

#include <chrono>

namespace pddcore::transfer {

bool FenceTable::install(uint64_t sender_engine_id, uint32_t transfer_tag, double timeout_s) {
  const Key key{sender_engine_id, transfer_tag};
  std::unique_lock<std::mutex> lock(mutex_);
  if (fenced_.insert(key).second) {
    order_.push_back(key);
    if (order_.size() > kMaxFences) {
      fenced_.erase(order_.front());
      order_.pop_front();
    }
  }
  written_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                    [&] { return closed_ || receiving_.count(key) == 0; });
  return receiving_.count(key) == 0;
}

bool FenceTable::begin(uint64_t sender_engine_id, uint32_t transfer_tag) {
  const Key key{sender_engine_id, transfer_tag};
  std::lock_guard<std::mutex> lock(mutex_);
  if (fenced_.count(key)) return false;
  ++receiving_[key];
  return true;
}

void FenceTable::end(uint64_t sender_engine_id, uint32_t transfer_tag) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = receiving_.find({sender_engine_id, transfer_tag});
    if (it != receiving_.end() && --it->second == 0) receiving_.erase(it);
  }
  written_.notify_all();
}

void FenceTable::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
  }
  written_.notify_all();
}

}  // namespace pddcore::transfer
