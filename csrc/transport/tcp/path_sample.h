// What the kernel measured on a TCP connection, for the delay pacer and the engine's stats.
#pragma once

#include <optional>

#include "delay_pacer.h"

namespace pddcore::transfer::tcp {

// Smoothed and minimum RTT, bytes acknowledged, the congestion window, retransmits, segments
// sent, whether slow start's end is behind it, the latest delivery-rate sample and whether sent data awaits its ack, from TCP_INFO; nullopt where the kernel does not report
// them (before Linux 4.6) or the socket is gone.
std::optional<PathSample> read_path_sample(int fd);

}  // namespace pddcore::transfer::tcp
