// The delay line's event loop: moves packets between two packet file descriptors (TUN
// devices in the WAN emulator) through one DelayQueue per direction, and publishes its
// counters into a caller-owned array (mapped from a file, so other processes can read it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace pddcore::wan {

struct DelayLineConfig {
  int fd_a = -1;     // packets read here leave through fd_b after the delay ("a_to_b")
  int fd_b = -1;     // and the other way round ("b_to_a")
  int stop_fd = -1;  // the loop returns once this becomes readable
  uint64_t delay_ns = 0;
  uint64_t jitter_ns = 0;
  double loss = 0.0;
  uint64_t seed = 0;
  size_t queue_bytes = 0;  // per direction
  int cpu = -1;            // pin the loop to this CPU; -1: leave affinity alone
};

// Names of the uint64 counters published by run_delay_line, in array order.
const std::vector<std::string>& delay_line_stat_names();

// Runs until stop_fd is readable. Throws std::invalid_argument on a bad configuration
// (before touching any fd) and std::runtime_error on a system call failure.
// `stats` must hold delay_line_stat_names().size() values.
void run_delay_line(const DelayLineConfig& config, uint64_t* stats, size_t stats_len);

}  // namespace pddcore::wan
