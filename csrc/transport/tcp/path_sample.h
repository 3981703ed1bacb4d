// What the kernel measured on a TCP connection, for the delay pacer.
#pragma once

#include <optional>

#include "delay_pacer.h"

namespace pddcore::transfer::tcp {

// Smoothed and minimum RTT and bytes acknowledged, from TCP_INFO; nullopt where the
// kernel does not report them (before Linux 4.6) or the socket is gone.
std::optional<PathSample> read_path_sample(int fd);

}  // namespace pddcore::transfer::tcp
