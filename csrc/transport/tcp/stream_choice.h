// streams="auto": how many data connections a peer gets, chosen from what its path shows
// (docs/transfer.md, "Streams") instead of a fixed number.
//
// A peer starts with kInitial connections (what loopback and one datacenter run best with
// on a small host: more only share the same cores). As the engine watches the path it
// adds connections, never removes any, up to kMax, whenever one of two limits holds:
//
//  1. Bandwidth-delay product. One connection keeps at most its kernel send buffer in
//     flight (tcp_wmem's ceiling; about half of it is payload, the rest is the kernel's
//     per-segment overhead), however long the path. Data in flight on the path is its
//     rate times its RTT; the connections need kHeadroom times that between them, so a
//     connection that loses a segment or a probing bbr still leaves the pipe full. The
//     rate is what the path delivered while it set the pace (the delivery meter), so on a
//     path where the windows are the limit it reads the windows' rate: rate x RTT then
//     equals the data the windows hold, and the rule asks for kHeadroom times as many
//     connections, until the path, not the windows, sets the pace.
//  2. Loss, for a loss-based congestion control (cubic): a connection losing a share p of
//     its segments holds about 1.22 / sqrt(p) segments in flight on average (the
//     steady-state window of loss-based TCP), so the rate needs rate x RTT / that many
//     segments' worth of connections. bbr does not back off on loss: for it the first
//     limit alone counts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace pddcore::transfer::tcp {

struct StreamRule {
  static constexpr uint32_t kInitial = 4;
  static constexpr uint32_t kMax = 16;
  static constexpr double kHeadroom = 2.0;
  // The share of a send buffer that is payload in flight.
  static constexpr double kPayloadShare = 0.5;

  struct Path {
    double min_rtt_s = 0;        // the path without a queue
    double rate_Bps = 0;         // delivered while the path set the pace; 0: not measured yet
    double loss = 0;             // retransmitted segments over segments sent
    uint64_t send_buffer_bytes = 0;  // one connection's send-buffer ceiling
    uint32_t segment_bytes = 1448;
    bool loss_based = false;     // the connections run a loss-based algorithm (cubic)
  };

  // How many connections the path asks for, between kInitial and kMax (kInitial until the
  // path's rate and RTT were measured).
  static uint32_t for_path(const Path& path) {
    if (!(path.rate_Bps > 0) || !(path.min_rtt_s > 0) || path.send_buffer_bytes == 0) return kInitial;
    const double in_flight = path.rate_Bps * path.min_rtt_s;
    double wanted = kHeadroom * in_flight / (kPayloadShare * static_cast<double>(path.send_buffer_bytes));
    if (path.loss_based && path.loss > 0)
      wanted = std::max(wanted, in_flight / (1.22 / std::sqrt(path.loss) * path.segment_bytes));
    if (!(wanted < kMax)) return kMax;  // also a NaN from a nonsense reading
    return std::clamp<uint32_t>(static_cast<uint32_t>(std::ceil(wanted)), kInitial, kMax);
  }
};

}  // namespace pddcore::transfer::tcp
