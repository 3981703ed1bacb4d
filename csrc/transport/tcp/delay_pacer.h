// Delay-based pacing of bulk data, in the spirit of LEDBAT.
//
// A bulk TCP transfer fills the bottleneck's queue, and every message that shares the
// path (the priority lane) then waits behind that queue: through a 1 Gbit/s, 50 ms RTT
// link about 3x its idle latency. A fixed rate limit below the line rate avoids that but
// needs the line rate. This pacer needs only a target queueing delay: it reads the queue
// as the connections' smoothed RTT above the path's minimum and sets the sending rate to
// what the path delivered lately, scaled up while the queue is below the target and down
// while it is above, in proportion to how far off it is. The queue settles at the target,
// the link stays busy. The gain is small next to the round trip (the queue answers a
// change one RTT late; a larger gain would swing), except while there is no queue to
// speak of, when the rate ramps up fast.
//
// Like every delay-based sender it cannot tell its own queue from delay it does not cause
// (a busy host, other traffic); it then slows down, but not below kFloorShare of the
// highest link rate it measured in the last kFloorMemoryNs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <utility>
#include <vector>

namespace pddcore::transfer {

// What the kernel measured on one connection (TCP_INFO).
struct PathSample {
  double srtt_s = 0;         // smoothed round-trip time
  double min_rtt_s = 0;      // lowest round-trip time seen: the path without a queue
  uint64_t bytes_acked = 0;  // acknowledged so far on this connection (it may restart at 0)
  uint64_t cwnd_bytes = 0;   // congestion window: segments x segment size
  uint64_t retransmits = 0;  // segments sent again, over the connection's life
  uint64_t segments_sent = 0;  // segments sent, retransmits included, over the connection's life
  bool past_slow_start = false;  // the initial slow start ended (a loss or HyStart)
  double delivery_rate_Bps = 0;       // the kernel's latest delivery-rate sample (one ack's worth)
  bool delivery_app_limited = true;   // that sample was taken while the sender had nothing to send
  bool data_outstanding = false;      // sent segments not yet acknowledged (a stall, not the end)
};

class DelayPacer {
 public:
  static constexpr double kRampGain = 0.25;     // with the queue under a quarter of the target, ...
  static constexpr double kRampBelowBusy = 0.9;  // ... while delivering less than this of the link's rate
  static constexpr double kSteerGain = 0.5;     // x target / feedback delay, near the target
  static constexpr double kAppLimitedShare = 0.8;  // delivered below this share of the rate: the sender idled
  static constexpr double kMinDrain = 0.5;     // deepest cut when draining a queue far beyond the target
  static constexpr double kFloorShare = 0.25;  // of the highest link rate in kFloorMemoryNs
  static constexpr int64_t kFloorMemoryNs = 10'000'000'000;
  static constexpr double kLinkRateMemoryS = 1.0;  // time constant of the link-rate average
  static constexpr int64_t kMinRevisionNs = 5'000'000;  // revise at most once per base RTT, >= 5 ms
  static constexpr int64_t kMaxBurstNs = 1'000'000;     // of unused rate a sender may spend at once
  // Delivered rate = bytes acknowledged over the last srtt, at least this long: shorter
  // spans see acks in bursts (one TSO batch, ack compression), not the link rate.
  static constexpr int64_t kMinRateSpanNs = 20'000'000;

  DelayPacer(double target_delay_s, size_t connections);

  // The latest measurement of one connection; the rate is revised at most once per base RTT.
  void observe(size_t connection, const PathSample& sample, int64_t now_ns);

  // Claims `bytes` of the paced rate: how many ns the sender waits before sending them.
  int64_t reserve(uint64_t bytes, int64_t now_ns);

  double rate_Bps() const { return rate_Bps_; }  // 0 while unpaced: no queue seen yet
  double queue_delay_s() const { return queue_delay_s_; }
  // What the link delivered while it had a queue (then that is its rate), a slow average;
  // 0 before the first queue.
  double link_rate_Bps() const { return link_rate_Bps_; }

 private:
  struct Latest {
    PathSample sample;
    bool seen = false;
  };

  void revise(int64_t now_ns);

  static int64_t rate_span_ns(double srtt_s);

  double floor_Bps() const;

  // Sliding-window maximum of the link-rate average (a monotonic deque, largest first).
  void remember_link_rate(int64_t now_ns);

  // Bytes acknowledged per second over the last srtt (at least kMinRateSpanNs); 0 until
  // that much history exists. A connection that restarted its count, or one counted for
  // the first time, resets the history: the sum jumps without any byte moving.
  double delivered_rate(uint64_t acked, size_t connections, int64_t now_ns, double srtt_s);

  const double target_s_;
  std::vector<Latest> latest_;
  std::vector<double> srtts_;                        // scratch for the median
  std::deque<std::pair<int64_t, uint64_t>> acked_;  // (when, bytes acknowledged on all connections)
  size_t counted_connections_ = 0;
  double rate_Bps_ = 0;
  double queue_delay_s_ = 0;
  int64_t base_rtt_ns_ = 0;
  int64_t next_revision_ns_ = 0;
  int64_t next_send_ns_ = 0;
  int64_t hold_until_ns_ = 0;
  double busy_rate_Bps_ = 0;  // delivered when the link last had a queue: its rate then
  double link_rate_Bps_ = 0;  // the same, averaged
  int64_t busy_seen_ns_ = 0;
  std::deque<std::pair<int64_t, double>> link_rates_;  // (when, link_rate_Bps_) for the floor
};

}  // namespace pddcore::transfer
