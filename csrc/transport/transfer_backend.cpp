// The out-of-line parts of pddcore/transfer_backend.h.
#include "pddcore/transfer_backend.h"

namespace pddcore::transfer {

std::string TransferState::error() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return error_;
}

bool TransferState::finish(TransferStatus status, std::string error) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (finished()) return false;
    error_ = std::move(error);
    status_.store(status, std::memory_order_release);
  }
  cv_.notify_all();
  return true;
}

bool TransferState::wait(double timeout_s) const {
  std::unique_lock<std::mutex> lock(mutex_);
  if (timeout_s < 0) {
    cv_.wait(lock, [this] { return finished(); });
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return finished(); });
}

std::string describe(const WriteChunk& c) {
  return "region " + std::to_string(c.dst_region) + ", offset " + std::to_string(c.dst_offset) + ", length " +
         std::to_string(c.length);
}

}  // namespace pddcore::transfer
