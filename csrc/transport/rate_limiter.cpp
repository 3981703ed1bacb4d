#include "rate_limiter.h"

#include <algorithm>
#include <chrono>

#include "pddcore/transfer_backend.h"

namespace pddcore::transfer {

void RateLimiter::pace(uint64_t bytes) {
  if (rate_bps_ <= 0) return;
  const double ns_per_byte = 8e9 / rate_bps_;
  std::unique_lock<std::mutex> lock(mutex_);
  const int64_t now = now_ns();
  const int64_t start = std::max(next_ns_, now - kBurstNs);
  next_ns_ = start + static_cast<int64_t>(static_cast<double>(bytes) * ns_per_byte);
  if (start > now) closed_cv_.wait_for(lock, std::chrono::nanoseconds(start - now), [this] { return closed_; });
}

void RateLimiter::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
  }
  closed_cv_.notify_all();
}

}  // namespace pddcore::transfer
