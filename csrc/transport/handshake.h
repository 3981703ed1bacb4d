// The handshake every connection to an engine starts with: protocol version check and,
// when the engine has an auth token, a mutual HMAC-SHA256 challenge-response over fresh
// nonces from both sides. The token itself never crosses the wire. Over TLS with
// certificates, the engine id each side states must be the one its certificate names.
#pragma once

#include <cstdint>
#include <optional>
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
// certified_client_id: the engine id the client's verified TLS certificate names (empty
// without certificates); a hello claiming another id is refused.
ClientHello accept_handshake(const Socket& s, const HandshakeConfig& cfg,
                             const std::optional<uint64_t>& certified_client_id);
// Client side; returns the server's engine id or throws TransferError naming the cause
// (with certified_server_id, also when the server states an id its certificate does not name).
uint64_t dial_handshake(const Socket& s, const HandshakeConfig& cfg, wire::ConnKind kind, uint8_t stream,
                        const std::optional<uint64_t>& certified_server_id);

// Cryptographically random bytes (OpenSSL RAND_bytes).
void random_bytes(void* out, size_t n);

}  // namespace pddcore::transfer
