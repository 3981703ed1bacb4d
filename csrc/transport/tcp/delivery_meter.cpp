#include "delivery_meter.h"

#include <algorithm>

namespace pddcore::transfer {

void DeliveryMeter::observe(const std::vector<std::pair<uint32_t, PathSample>>& samples, int64_t now_ns) {
  // Two senders may read the streams at nearly the same moment and report in either order.
  if (now_ns < last_ns_) return;
  const bool limited_since_last = path_limited_;
  const bool outstanding_since_last = data_outstanding_;
  const int64_t step = now_ns - last_ns_;
  uint64_t delivered = 0;
  int64_t window = kMinDeliveringNs;
  path_limited_ = false;
  data_outstanding_ = false;
  last_ns_ = now_ns;
  for (const auto& [index, sample] : samples) {
    auto [it, first_seen] = connections_.try_emplace(index);
    Connection& c = it->second;
    // A reconnected stream starts counting at 0 again: a new baseline, not a delivery.
    const bool restarted = sample.bytes_acked < c.bytes_acked;
    if (!first_seen && !restarted && sample.bytes_acked > c.bytes_acked) {
      delivered += sample.bytes_acked - c.bytes_acked;
      c.advanced_ns = now_ns;
    }
    c.bytes_acked = sample.bytes_acked;
    data_outstanding_ = data_outstanding_ || sample.data_outstanding;
    if (first_seen || restarted) continue;
    const int64_t delivering = std::max(kMinDeliveringNs, static_cast<int64_t>(sample.srtt_s * 1e9));
    window = std::max(window, delivering);
    // An idle connection's last sample may be stale and unflagged; only live ones count.
    if (now_ns - c.advanced_ns <= delivering && !sample.delivery_app_limited) path_limited_ = true;
  }
  // A busy link is looked at every few acks, and acks come in bunches: a look that finds
  // nothing new acknowledged is held until the next look that does, so the time between
  // bunches counts with the bytes after it. So does a silence while sent data awaited its
  // ack (a loss being repaired: the cumulative ack then jumps). A look after a longer
  // silence with nothing outstanding (the transfer ended in between), or one after a look
  // that found the link no longer the limit, ends the stretch: what was held is dropped,
  // and so are bytes whose arrival time is unknown.
  if (!limited_since_last || (step > window && !outstanding_since_last)) {
    held_ns_ = 0;
    return;
  }
  held_ns_ += step;
  if (delivered == 0) return;
  bytes_ += static_cast<double>(delivered);
  ns_ += held_ns_;
  held_ns_ = 0;
}

}  // namespace pddcore::transfer
