#include "delivery_meter.h"

#include <algorithm>

namespace pddcore::transfer {

void DeliveryMeter::observe(const std::vector<std::pair<uint32_t, PathSample>>& samples, int64_t now_ns) {
  // Two senders may read the streams at nearly the same moment and report in either order.
  if (now_ns < last_ns_) return;
  if (rate_Bps_ > 0) {
    const int64_t step = std::min(now_ns - last_ns_, kMaxStepNs);
    bytes_ += rate_Bps_ * static_cast<double>(step) * 1e-9;
    ns_ += step;
  }
  rate_Bps_ = 0;
  last_ns_ = now_ns;
  for (const auto& [index, sample] : samples) {
    auto [it, first_seen] = connections_.try_emplace(index);
    Connection& c = it->second;
    if (!first_seen && sample.bytes_acked > c.bytes_acked) c.advanced_ns = now_ns;
    // A reconnected stream starts counting at 0 again: a new baseline, not a delivery.
    const bool restarted = sample.bytes_acked < c.bytes_acked;
    c.bytes_acked = sample.bytes_acked;
    if (first_seen || restarted) continue;
    const int64_t window = std::max(kMinDeliveringNs, static_cast<int64_t>(sample.srtt_s * 1e9));
    // An idle connection's last sample may be stale and unflagged; only live ones count.
    if (now_ns - c.advanced_ns <= window && !sample.delivery_app_limited) rate_Bps_ += sample.delivery_rate_Bps;
  }
}

}  // namespace pddcore::transfer
