// The handshake every connection to an engine starts with: protocol version check and,
// when the engine has an auth token, a mutual HMAC-SHA256 challenge-response over fresh
// nonces from both sides. The token itself never crosses the wire.
#pragma once

#include <cstdint>
#include <string>

#include "pddcore/wire.h"
#include "socket.h"

namespace pddcore::transfer {

struct HandshakeConfig {
  uint64_t engine_id = 0;
  std::string address;  // this engine's listen address
  bool has_token = false;
  std::string token;
  double timeout_s = 30.0;
};

// What a server learns about the client of an accepted connection.
struct ClientHello {
  wire::ConnKind kind;
  uint8_t stream;
  uint64_t engine_id;
  std::string address;
};

// Server side; throws TransferError (after telling the client why) when refused.
ClientHello accept_handshake(const Socket& s, const HandshakeConfig& cfg);
// Client side; returns the server's engine id or throws TransferError naming the cause.
uint64_t dial_handshake(const Socket& s, const HandshakeConfig& cfg, wire::ConnKind kind, uint8_t stream);

// Cryptographically random bytes (OpenSSL RAND_bytes).
void random_bytes(void* out, size_t n);

}  // namespace pddcore::transfer
