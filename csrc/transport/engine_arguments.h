// The transfer engine's arguments as its caller gives them (as wide as Python's ints and
// floats, absent ones as std::nullopt), and the one place they are checked: each alone,
// and against each other, before any of them is narrowed into EngineOptions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "pddcore/transfer_backend.h"

namespace pddcore::transfer {

// An auth token keys the handshake's HMAC and the TLS PSK: one captured handshake lets an
// attacker test guesses offline, as fast as they can compute HMACs, so only a token with
// at least 128 random bits stands that. How random a token is cannot be seen, so what is
// certainly too weak is refused: fewer than 32 bytes (128 random bits written as hex) or
// fewer than 8 distinct bytes (a repeated word).
constexpr size_t kMinAuthTokenBytes = 32;
constexpr size_t kMinAuthTokenDistinctBytes = 8;

// Data connections (tcp) or QPs (rdma) per peer at most; "auto" on rdma runs kAutoQps.
constexpr int64_t kMaxStreams = 64;
constexpr uint32_t kAutoQps = 4;

// The bindings fill it in this order (aggregate initialization).
struct EngineArguments {
  std::string backend = "tcp";
  std::string listen = "127.0.0.1:0";
  std::optional<int64_t> streams;  // nullopt: "auto" (tcp: chosen per peer from its path)
  int64_t chunk_bytes = 1 << 20;
  std::optional<std::string> auth_token;
  bool insecure = false;  // may listen beyond loopback without auth_token or certificates
  bool tls = false;
  std::string tls_ca, tls_cert, tls_key;  // PEM files: all three (certificates imply tls) or none
  std::optional<std::string> congestion_control;  // nullopt: the system default; "auto": per connection
  double timeout_s = 30.0;
  std::optional<double> rate_limit_bps;        // nullopt: unlimited
  std::optional<double> queue_delay_target_s;  // nullopt: no pacer
  int64_t max_retries = 5;
  int64_t max_connections = 1024;
  int64_t max_connections_per_host = 256;
  int64_t max_inbox_bytes = 64 << 20;
  double idle_timeout_s = 300.0;
  std::optional<std::string> rdma_device;  // rdma only, as ib_port and gid_index
  int64_t ib_port = 1;
  std::optional<int64_t> gid_index;
};

// The engine's options from `a` once every argument is checked. Throws
// std::invalid_argument naming the argument and the value it refuses.
EngineOptions engine_options(const EngineArguments& a);

// The TCP congestion controls this kernel offers (none where /proc does not say).
std::vector<std::string> available_congestion_controls();

}  // namespace pddcore::transfer
