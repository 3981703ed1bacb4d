// The engine-wide rate limit (rate_limit_bps): a token bucket shared by every backend's
// senders, with up to kBurstNs of unused rate spendable at once.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>

namespace pddcore::transfer {

class RateLimiter {
 public:
  // bits per second; 0: unlimited (pace() returns at once).
  explicit RateLimiter(double rate_bps) : rate_bps_(rate_bps) {}

  // Blocks until the limit admits `bytes` more, or close() is called.
  void pace(uint64_t bytes);
  void close();

 private:
  static constexpr int64_t kBurstNs = 10'000'000;
  const double rate_bps_;
  std::mutex mutex_;
  std::condition_variable closed_cv_;
  int64_t next_ns_ = 0;
  bool closed_ = false;
};

}  // namespace pddcore::transfer
