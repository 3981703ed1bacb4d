// The rate a link delivers when the link, not the sender, sets the pace: what the router
// prices a transfer with.
//
// Bytes over busy time (the engine's `throughput_bps`) reads low whenever a sender streams
// data as it is produced, a prefill posting layer after layer: the transfers stay open
// while the link waits on the model, and each small one ends on a round trip. TCP itself
// samples each connection's delivery rate per ack and flags the samples taken while the
// sender had nothing to send (application-limited). This meter sums, whenever the engine
// looks, the latest samples the path limited on the connections that are delivering right
// now, and integrates that sum over time: the ratio of its two counters is the link's rate
// averaged over the time the link was the limit. Without such time (small transfers only)
// both stay 0 and say nothing, which is the truth.
#pragma once

#include <cstdint>
#include <limits>
#include <map>
#include <utility>
#include <vector>

#include "delay_pacer.h"

namespace pddcore::transfer {

class DeliveryMeter {
 public:
  // One reading stands for the time until the next, at most this long: the engine may
  // not look again before its next transfer.
  static constexpr int64_t kMaxStepNs = 100'000'000;
  // A connection counts as delivering if its acknowledged bytes grew within its smoothed
  // RTT, at least this long (acks come in bursts, not every millisecond).
  static constexpr int64_t kMinDeliveringNs = 20'000'000;

  // Every connection's sample, all taken at `now_ns` (a connection is named by its index).
  void observe(const std::vector<std::pair<uint32_t, PathSample>>& samples, int64_t now_ns);

  double bytes() const { return bytes_; }        // the integrated rate: bytes at that rate
  double seconds() const { return ns_ * 1e-9; }  // time the link was the limit

 private:
  struct Connection {
    uint64_t bytes_acked = 0;
    int64_t advanced_ns = std::numeric_limits<int64_t>::min() / 2;  // when bytes_acked last grew (never)
  };
  std::map<uint32_t, Connection> connections_;
  double rate_Bps_ = 0;  // at the last observation; 0: no connection was path-limited
  int64_t last_ns_ = 0;
  double bytes_ = 0;
  int64_t ns_ = 0;
};

}  // namespace pddcore::transfer
