#include "delay_pacer.h"

#include <algorithm>
#include <stdexcept>

namespace pddcore::transfer {

DelayPacer::DelayPacer(double target_delay_s, size_t connections) : target_s_(target_delay_s), latest_(connections) {
  if (!(target_delay_s > 0)) throw std::invalid_argument("target queueing delay must be positive");
  if (connections == 0) throw std::invalid_argument("a pacer needs at least one connection");
}

void DelayPacer::observe(size_t connection, const PathSample& sample, int64_t now_ns) {
  if (connection >= latest_.size() || !(sample.srtt_s > 0) || !(sample.min_rtt_s > 0)) return;
  latest_[connection] = {sample, true};
  if (now_ns >= next_revision_ns_) revise(now_ns);
}

int64_t DelayPacer::reserve(uint64_t bytes, int64_t now_ns) {
  if (rate_Bps_ <= 0) return 0;
  // Unused rate expires quickly: a burst after a pause would queue at the bottleneck.
  const int64_t start = std::max(next_send_ns_, now_ns - kMaxBurstNs);
  next_send_ns_ = start + static_cast<int64_t>(static_cast<double>(bytes) * 1e9 / rate_Bps_);
  return std::max<int64_t>(0, start - now_ns);
}

void DelayPacer::revise(int64_t now_ns) {
  double base = 0;
  uint64_t acked = 0;
  srtts_.clear();
  for (const Latest& l : latest_) {
    if (!l.seen) continue;
    base = srtts_.empty() ? l.sample.min_rtt_s : std::min(base, l.sample.min_rtt_s);
    srtts_.push_back(l.sample.srtt_s);
    acked += l.sample.bytes_acked;
  }
  // The median: the queue shows on every connection, one connection's burst does not.
  std::sort(srtts_.begin(), srtts_.end());
  const size_t n = srtts_.size();
  const double srtt = (srtts_[(n - 1) / 2] + srtts_[n / 2]) / 2;
  base_rtt_ns_ = static_cast<int64_t>(base * 1e9);
  queue_delay_s_ = std::max(0.0, srtt - base);
  next_revision_ns_ = now_ns + std::max(kMinRevisionNs, base_rtt_ns_);
  const double delivered = delivered_rate(acked, srtts_.size(), now_ns, srtt);
  if (delivered <= 0) return;
  // How late a change of rate shows in what is measured: a round trip, or the span the
  // delivered rate is averaged over.
  const double feedback_s = static_cast<double>(rate_span_ns(srtt)) * 1e-9;
  // With a queue, the link is busy and what it delivers is its rate. Single readings
  // jump (a burst of late acks after a repaired loss, as after slow start's overshoot,
  // which is why the average starts once pacing has): the average is for the floor.
  if (queue_delay_s_ > target_s_ / 2) {
    busy_rate_Bps_ = delivered;
    if (rate_Bps_ > 0) {
      const double weight = std::min(1.0, static_cast<double>(now_ns - busy_seen_ns_) * 1e-9 / kLinkRateMemoryS);
      const double reading = link_rate_Bps_ > 0 ? std::min(delivered, 2 * link_rate_Bps_) : delivered;
      link_rate_Bps_ = link_rate_Bps_ > 0 ? link_rate_Bps_ + weight * (reading - link_rate_Bps_) : reading;
      busy_seen_ns_ = now_ns;
      remember_link_rate(now_ns);
    }
  }
  if (now_ns < hold_until_ns_) return;
  if (rate_Bps_ <= 0 ? queue_delay_s_ > target_s_ : queue_delay_s_ > 2 * target_s_) {
    // Far beyond the target (slow start's overshoot when pacing begins, or a path that
    // got slower): the link is busy and delivers its rate; go below it by as much as
    // drains the excess within about a round trip, and wait that long to see the effect.
    rate_Bps_ = std::max(floor_Bps(), delivered * std::max(kMinDrain, 1.0 - (queue_delay_s_ - target_s_) / srtt));
    hold_until_ns_ = now_ns + static_cast<int64_t>(srtt * 1e9);
    return;
  }
  if (rate_Bps_ <= 0) return;
  // Without a queue, a path that delivered less than the rate was not given more: the
  // sender idled and learned nothing about the path.
  const bool no_queue = queue_delay_s_ < target_s_ / 4;
  if (no_queue && delivered < kAppLimitedShare * rate_Bps_) return;
  const double off_target = std::clamp((target_s_ - queue_delay_s_) / target_s_, -1.0, 1.0);
  // Fast back up to the rate the link last showed, carefully beyond it.
  const double gain = no_queue && delivered < kRampBelowBusy * busy_rate_Bps_
                          ? kRampGain
                          : std::min(kRampGain, kSteerGain * target_s_ / feedback_s);
  rate_Bps_ = std::max(floor_Bps(), delivered * (1 + gain * off_target));
}

int64_t DelayPacer::rate_span_ns(double srtt_s) {
  return std::max(kMinRateSpanNs, static_cast<int64_t>(srtt_s * 1e9));
}

double DelayPacer::floor_Bps() const { return link_rates_.empty() ? 0 : kFloorShare * link_rates_.front().second; }

void DelayPacer::remember_link_rate(int64_t now_ns) {
  while (!link_rates_.empty() && link_rates_.back().second <= link_rate_Bps_) link_rates_.pop_back();
  link_rates_.emplace_back(now_ns, link_rate_Bps_);
  while (link_rates_.front().first < now_ns - kFloorMemoryNs) link_rates_.pop_front();
}

double DelayPacer::delivered_rate(uint64_t acked, size_t connections, int64_t now_ns, double srtt_s) {
  if (connections != counted_connections_ || (!acked_.empty() && acked < acked_.back().second)) acked_.clear();
  counted_connections_ = connections;
  acked_.emplace_back(now_ns, acked);
  const int64_t span_ns = rate_span_ns(srtt_s);
  while (acked_.size() > 2 && acked_[1].first <= now_ns - span_ns) acked_.pop_front();
  const auto& [then_ns, then_acked] = acked_.front();
  if (now_ns - then_ns < span_ns) return 0;
  return static_cast<double>(acked - then_acked) * 1e9 / static_cast<double>(now_ns - then_ns);
}

}  // namespace pddcore::transfer
