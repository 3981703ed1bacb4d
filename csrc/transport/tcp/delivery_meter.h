// The rate a link delivers when the link, not the sender, sets the pace: what the router
// prices a transfer with.
//
// Bytes over busy time (the engine's `throughput_bps`) reads low whenever a sender streams
// data as it is produced, a prefill posting layer after layer: the transfers stay open
// while the link waits on the model, and each small one ends on a round trip. TCP itself
// samples each connection's delivery rate per ack and flags the samples taken while the
// sender had nothing to send (application-limited). This meter looks at the connections
// whenever the engine does: the time from one look to the next counts as path-limited when
// at the first look a connection was delivering with an unflagged sample, once some bytes
// were acknowledged by then or by a later look of the same busy stretch, and it counts those
// bytes, as the kernel's acknowledged-byte counters say. The ratio of its two counters is the link's rate averaged over the time the
// link was the limit. The rate samples themselves are never summed or integrated: one
// sample measures a single ack's burst, and on a shared CPU (loopback) connections deliver
// in turns, each burst at several times the rate they share, so their sum read up to 20x the
// bytes actually sent. Without path-limited time (small transfers only) both counters stay
// 0 and say nothing, which is the truth.
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
  // A connection counts as delivering if its acknowledged bytes grew within its smoothed
  // RTT, at least this long (acks come in bursts, not every millisecond); two looks further
  // apart than that, with no data awaiting acks at the first, say nothing about the time
  // between them.
  static constexpr int64_t kMinDeliveringNs = 20'000'000;

  // Every connection's sample, all taken at `now_ns` (a connection is named by its index).
  void observe(const std::vector<std::pair<uint32_t, PathSample>>& samples, int64_t now_ns);

  double bytes() const { return bytes_; }        // acknowledged while the link was the limit
  double seconds() const { return ns_ * 1e-9; }  // time the link was the limit

 private:
  struct Connection {
    uint64_t bytes_acked = 0;
    int64_t advanced_ns = std::numeric_limits<int64_t>::min() / 2;  // when bytes_acked last grew (never)
  };
  std::map<uint32_t, Connection> connections_;
  bool path_limited_ = false;  // at the last observation a delivering connection's sample was unflagged
  int64_t held_ns_ = 0;        // path-limited time since the last look that found bytes acknowledged
  bool data_outstanding_ = false;  // at the last observation a connection awaited acks
  int64_t last_ns_ = 0;
  double bytes_ = 0;
  int64_t ns_ = 0;
};

}  // namespace pddcore::transfer
