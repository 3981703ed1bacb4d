#include "path_sample.h"

#include <linux/tcp.h>  // tcp_info with tcpi_bytes_acked and tcpi_min_rtt (glibc's copy lacks them)
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstddef>

namespace pddcore::transfer::tcp {

std::optional<PathSample> read_path_sample(int fd) {
  tcp_info info{};
  socklen_t len = sizeof(info);
  if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0) return std::nullopt;
  if (len < offsetof(tcp_info, tcpi_min_rtt) + sizeof(info.tcpi_min_rtt)) return std::nullopt;
  PathSample sample{info.tcpi_rtt * 1e-6, info.tcpi_min_rtt * 1e-6, info.tcpi_bytes_acked,
                    static_cast<uint64_t>(info.tcpi_snd_cwnd) * info.tcpi_snd_mss, info.tcpi_total_retrans,
                    info.tcpi_segs_out,
                    info.tcpi_snd_ssthresh != 0};  // the kernel reports 0 during the initial slow start
  sample.data_outstanding = info.tcpi_unacked > 0;
  // Delivery-rate samples came with Linux 4.9; older kernels leave the sample app-limited (unused).
  if (len >= offsetof(tcp_info, tcpi_delivery_rate) + sizeof(info.tcpi_delivery_rate)) {
    sample.delivery_rate_Bps = static_cast<double>(info.tcpi_delivery_rate);
    sample.delivery_app_limited = info.tcpi_delivery_rate_app_limited;
  }
  return sample;
}

}  // namespace pddcore::transfer::tcp
