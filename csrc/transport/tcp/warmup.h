// Warming a fresh data connection on a long path (docs/transfer.md, "Warm connections").
//
// A new TCP connection starts with a window of ten segments and doubles it per round trip
// (slow start; bbr's startup alike): on a 1 Gbit/s, 50 ms path the first 256 MiB ran at
// 0.77x line rate on fresh connections and 0.90x on connections an earlier write had
// brought up (2026-12-03). Where the handshake measured a long path and nothing is queued,
// a stream therefore sends padding (wire::ChunkHeader::kWarmup, dropped by the receiver)
// until the connection is past its ramp: slow start ended (cubic; after a switch to bbr the
// kernel reports a slow-start threshold though bbr has none), or the delivery rate
// stopped growing by kGrowth over kFlatRounds round trips (as bbr judges its own startup),
// or kMaxRounds round trips or kMaxBytes passed. Real data stops it at once. bbr keeps
// what it learned across idle time (no slow start after idle), so the next write starts at
// the path's rate.
#pragma once

#include <cstdint>

#include "delay_pacer.h"

namespace pddcore::transfer::tcp {

class WarmupJudge {
 public:
  static constexpr double kMinRttS = 0.005;  // shorter paths ramp in a few milliseconds
  static constexpr double kGrowth = 1.25;
  static constexpr int kFlatRounds = 3;
  static constexpr int kMaxRounds = 40;
  static constexpr uint64_t kMaxBytes = 64ull << 20;

  // `loss_based`: the connection runs cubic (or another algorithm with a slow start whose
  // end TCP_INFO reports); bbr's startup is judged by its delivery rate alone.
  explicit WarmupJudge(bool loss_based) : loss_based_(loss_based) {}

  // Whether a connection whose handshake measured `min_rtt_s` is worth warming.
  static bool worth_warming(double min_rtt_s) { return min_rtt_s >= kMinRttS; }

  // Feeds what the connection shows at `now_ns` after `bytes_sent` bytes of padding;
  // returns true once it is warm (or warming should stop).
  bool warm(const PathSample& s, int64_t now_ns, uint64_t bytes_sent) {
    if ((loss_based_ && s.past_slow_start) || bytes_sent >= kMaxBytes) return true;
    if (!s.delivery_app_limited && s.delivery_rate_Bps > max_rate_Bps_) max_rate_Bps_ = s.delivery_rate_Bps;
    const double rtt_s = s.min_rtt_s > 0 ? s.min_rtt_s : kMinRttS;
    if (round_start_ns_ == 0) round_start_ns_ = now_ns;
    if (static_cast<double>(now_ns - round_start_ns_) < rtt_s * 1e9) return false;
    round_start_ns_ = now_ns;  // a round trip passed: judge the growth
    if (++rounds_ >= kMaxRounds) return true;
    if (max_rate_Bps_ >= kGrowth * plateau_Bps_) {
      plateau_Bps_ = max_rate_Bps_;
      flat_rounds_ = 0;
      return false;
    }
    return ++flat_rounds_ >= kFlatRounds;
  }

 private:
  bool loss_based_;
  double max_rate_Bps_ = 0;
  double plateau_Bps_ = 0;
  int64_t round_start_ns_ = 0;
  int rounds_ = 0;
  int flat_rounds_ = 0;
};

}  // namespace pddcore::transfer::tcp
