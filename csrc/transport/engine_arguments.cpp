// The transfer engine's arguments, checked in one place.
#include "engine_arguments.h"

#include <arpa/inet.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <stdexcept>

#include "pddcore/wire.h"
#include "socket.h"

namespace pddcore::transfer {
namespace {

std::string text(double v) {
  std::ostringstream out;
  out << v;
  return out.str();
}

int64_t in_range(const char* name, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi)
    throw std::invalid_argument(std::string(name) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                                "], got " + std::to_string(v));
  return v;
}

double positive(const char* name, double v) {
  if (!(v > 0)) throw std::invalid_argument(std::string(name) + " must be positive, got " + text(v));
  return v;
}

// Engines listen on IPv4 literals or names (socket.h).
bool is_loopback(const std::string& host) {
  in_addr v4{};
  return host == "localhost" || (inet_pton(AF_INET, host.c_str(), &v4) == 1 && (ntohl(v4.s_addr) >> 24) == 127);
}

void check_auth_token(const std::string& token) {
  const size_t distinct = std::set<char>(token.begin(), token.end()).size();
  if (token.size() < kMinAuthTokenBytes || distinct < kMinAuthTokenDistinctBytes)
    throw std::invalid_argument(
        "auth_token must hold at least 128 random bits: at least " + std::to_string(kMinAuthTokenBytes) +
        " bytes (128 bits as hex) of at least " + std::to_string(kMinAuthTokenDistinctBytes) +
        " distinct values, got " + std::to_string(token.size()) + " bytes of " + std::to_string(distinct) +
        "; `pddcore token` (or pddcore.transfer.new_auth_token()) prints a new 256-bit one");
}

// "auto" dials with cubic (tcp/congestion_choice.h); a kernel without it gets the system default.
std::string congestion_control(const std::optional<std::string>& asked) {
  if (!asked) return "";
  const std::vector<std::string> offered = available_congestion_controls();
  const bool has = std::find(offered.begin(), offered.end(), *asked == "auto" ? "cubic" : *asked) != offered.end();
  if (*asked == "auto") return has ? "auto" : "";
  if (!has) {
    std::string names;
    for (const std::string& n : offered) names += (names.empty() ? "" : ", ") + n;
    throw std::invalid_argument("congestion_control '" + *asked + "' is not offered by this kernel; available: " +
                                names);
  }
  return *asked;
}

}  // namespace

std::vector<std::string> available_congestion_controls() {
  std::ifstream f("/proc/sys/net/ipv4/tcp_available_congestion_control");
  std::vector<std::string> names;
  for (std::string name; f >> name;) names.push_back(name);
  return names;
}

EngineOptions engine_options(const EngineArguments& a) {
  constexpr int64_t kU32 = std::numeric_limits<uint32_t>::max();
  constexpr int64_t kI32 = std::numeric_limits<int>::max();
  EngineOptions o;
  o.backend = a.backend;
  HostPort listen;
  try {
    listen = parse_address(a.listen);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("listen: ") + e.what());
  }
  o.listen_host = listen.host;
  o.listen_port = listen.port;
  // 0: "auto", the tcp backend chooses per peer from the path (tcp/stream_choice.h).
  o.streams = a.streams ? static_cast<uint32_t>(in_range("streams", *a.streams, 1, kMaxStreams))
                        : (a.backend == "tcp" ? 0 : kAutoQps);
  o.chunk_bytes = static_cast<uint32_t>(in_range("chunk_bytes", a.chunk_bytes, 1, wire::kMaxChunkBytes));

  if (a.auth_token) check_auth_token(*a.auth_token);
  o.has_token = a.auth_token.has_value();
  o.auth_token = a.auth_token.value_or("");
  const int certificate_files = !a.tls_cert.empty() + !a.tls_key.empty() + !a.tls_ca.empty();
  if (certificate_files != 0 && certificate_files != 3)
    throw std::invalid_argument("TLS with certificates needs all of tls_cert, tls_key and tls_ca");
  const bool certificates = certificate_files == 3;
  if (!o.has_token && !certificates && !a.insecure && !is_loopback(o.listen_host))
    throw std::invalid_argument("an engine listening on " + o.listen_host +
                                " (reachable from other machines) needs an auth_token or certificates: without "
                                "either anybody who reaches the port can write into its target regions. Pass "
                                "auth_token=..., tls_cert/tls_key/tls_ca, or insecure=True on a network you trust");
  o.tls = a.tls || certificates;
  if (o.tls && !o.has_token && !certificates)
    throw std::invalid_argument(
        "tls=True needs an auth_token (the TLS pre-shared key is derived from it) or tls_cert/tls_key/tls_ca");
  o.tls_ca_file = a.tls_ca;
  o.tls_cert_file = a.tls_cert;
  o.tls_key_file = a.tls_key;
  o.congestion_control = congestion_control(a.congestion_control);

  o.timeout_s = positive("timeout_s", a.timeout_s);
  o.idle_timeout_s = positive("idle_timeout_s", a.idle_timeout_s);
  o.rate_limit_bps = a.rate_limit_bps ? positive("rate_limit_bps", *a.rate_limit_bps) : 0.0;
  o.queue_delay_target_s = a.queue_delay_target_s ? positive("queue_delay_target_s", *a.queue_delay_target_s) : 0.0;
  o.max_retries = static_cast<uint32_t>(in_range("max_retries", a.max_retries, 0, kU32));
  o.max_connections = static_cast<uint32_t>(in_range("max_connections", a.max_connections, 1, kU32));
  o.max_connections_per_host =
      static_cast<uint32_t>(in_range("max_connections_per_host", a.max_connections_per_host, 1, kU32));
  o.max_inbox_bytes =
      static_cast<uint64_t>(in_range("max_inbox_bytes", a.max_inbox_bytes, 1, std::numeric_limits<int64_t>::max()));

  if (a.backend != "rdma" && (a.rdma_device || a.gid_index || a.ib_port != 1))
    throw std::invalid_argument("device, ib_port and gid_index apply to the rdma backend, not '" + a.backend + "'");
  if (a.ib_port < 1 || a.ib_port > 255 || (a.gid_index && (*a.gid_index < 0 || *a.gid_index > kI32)))
    throw std::invalid_argument("bad RDMA port " + std::to_string(a.ib_port) + " or GID index " +
                                (a.gid_index ? std::to_string(*a.gid_index) : std::string("None")));
  o.rdma_device = a.rdma_device.value_or("");
  o.ib_port = static_cast<uint8_t>(a.ib_port);
  o.gid_index = a.gid_index ? static_cast<int>(*a.gid_index) : -1;
  return o;
}

}  // namespace pddcore::transfer
