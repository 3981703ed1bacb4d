// congestion_control="auto": which TCP congestion control a data connection runs, chosen
// from what its own path shows (docs/transfer.md, "Congestion control"):
//
//  1. After the handshake, the connection's minimum RTT (TCP_INFO, several round trips in):
//     below kLongPathRttS the path is short (loopback, one datacenter) and the connection
//     runs cubic: there bbr's pacing and probing cost throughput (0.55-0.64x cubic's on
//     loopback). From kLongPathRttS on the path is long and it runs bbr, which keeps the
//     pipe full where loss-based cubic backs off at every drop (1 Gbit/s, 50 ms RTT,
//     0.1 % loss: 0.61x line rate with cubic, 0.91x with bbr) and is level with it on a
//     clean long path.
//  2. As it runs, a cubic connection whose retransmits reach kLossyShare of the segments
//     it sent (once it sent kMinSegments) while no queue stood on its path is on a lossy
//     path: it, the peer's other connections and every later one switch to bbr (LossCount
//     adds up the stretches between readings that qualify). Drops
//     where a queue stands (see queued()) and during the initial slow start, whose end
//     overfills the bottleneck's queue, are cubic's own: it fills every queue until it
//     overflows (on an emulated 1 Gbit/s, 2 ms path with a 10 ms queue, 4 cubic
//     connections retransmit 15 % of their segments), so they are not counted, nor are
//     any under kLossyPathMinRttS of minimum RTT (loopback, one datacenter): drops there
//     are the hosts' own (loopback on this loaded 2-core machine retransmits a few 64 KiB
//     segments per 256 MiB, and one benchmark run ended with all its loopback connections
//     on bbr). Never
//     back: bbr's own retransmits (it probes the queue) say nothing about the path either.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

namespace pddcore::transfer::tcp {

struct CongestionRule {
  static constexpr double kLongPathRttS = 0.005;
  static constexpr double kLossyShare = 0.01;
  static constexpr uint64_t kMinSegments = 1000;
  static constexpr double kMinQueueS = 0.001;
  static constexpr double kLossyPathMinRttS = 0.001;
  static constexpr const char* kShortPath = "cubic";
  static constexpr const char* kLongPath = "bbr";
  static constexpr const char* kLossyPath = "bbr";
  // What a connection is dialled with, before its handshake measured the path. Not bbr:
  // bbr turns the socket's pacing on, and a switch to cubic leaves it on (on loopback,
  // 0.75-0.81x the throughput of a connection that ran cubic from the start).
  static constexpr const char* kBeforeHandshake = kShortPath;

  // The algorithm a connection starts with, from its minimum RTT after the handshake
  // (0 or less: the kernel measured none, taken as short).
  static const char* after_handshake(double min_rtt_s) {
    return min_rtt_s >= kLongPathRttS ? kLongPath : kShortPath;
  }
  // Whether a queue stands on the connection's path, so its drops may be its own: the
  // smoothed RTT is above the minimum by as much again, and by kMinQueueS at least (on a
  // short path a busy host's scheduling alone adds a fraction of a millisecond).
  static bool queued(double srtt_s, double min_rtt_s) {
    return srtt_s - min_rtt_s >= std::max(min_rtt_s, kMinQueueS);
  }
  // Whether a connection with this minimum RTT that sent `segments`, `retransmits` of them
  // again, all past slow start and with no queue standing, shows a lossy path.
  static bool lossy(double min_rtt_s, uint64_t segments, uint64_t retransmits) {
    return min_rtt_s >= kLossyPathMinRttS && segments >= kMinSegments &&
           static_cast<double>(retransmits) >= kLossyShare * static_cast<double>(segments);
  }
};

// A cubic connection's segments and retransmits, added up over the stretches between two
// readings of its counters that can say something about the path: past the initial slow
// start, with no queue standing when the stretch ended. A stretch that does not qualify is
// left out, not the count so far: on a busy host a moment's scheduling delay in the path
// reads as a queue, and restarting the count at each one kept a path that dropped 3 % of
// its packets from ever adding up to kMinSegments.
class LossCount {
 public:
  // One reading (counters since the connection opened); true once the stretches counted
  // show a lossy path.
  bool observe(double srtt_s, double min_rtt_s, bool past_slow_start, uint64_t segments_sent, uint64_t retransmits) {
    if (previous_ && past_slow_start && !CongestionRule::queued(srtt_s, min_rtt_s)) {
      segments_ += segments_sent - previous_->first;
      retransmits_ += retransmits - previous_->second;
    }
    previous_.emplace(segments_sent, retransmits);
    return CongestionRule::lossy(min_rtt_s, segments_, retransmits_);
  }

 private:
  std::optional<std::pair<uint64_t, uint64_t>> previous_;  // the last reading's counters
  uint64_t segments_ = 0, retransmits_ = 0;                // over the stretches counted
};

}  // namespace pddcore::transfer::tcp
