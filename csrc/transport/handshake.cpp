#include "handshake.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstring>

#include "pddcore/transfer_backend.h"

namespace pddcore::transfer {

namespace {

using Mac = uint8_t[wire::kMacBytes];

// HMAC over everything both sides said, with a label per direction, so a proof can be
// replayed neither on another connection nor back to its sender. The server's proof also
// covers the engine id it states in its Result (client proof: no id).
void transcript_mac(const std::string& token, const char* label, const wire::Hello& hello,
                    const wire::Challenge& challenge, std::optional<uint64_t> server_id, Mac out) {
  uint8_t hello_bytes[wire::Hello::kSize], challenge_bytes[wire::Challenge::kSize], id_bytes[8];
  hello.encode(hello_bytes);
  challenge.encode(challenge_bytes);
  std::string data(label);
  data.append(reinterpret_cast<const char*>(hello_bytes), sizeof(hello_bytes));
  data.append(reinterpret_cast<const char*>(challenge_bytes), sizeof(challenge_bytes));
  if (server_id) {
    wire::Writer(id_bytes).put(*server_id);
    data.append(reinterpret_cast<const char*>(id_bytes), sizeof(id_bytes));
  }
  unsigned int len = wire::kMacBytes;
  const bool ok = HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
                       reinterpret_cast<const uint8_t*>(data.data()), data.size(), out, &len) != nullptr;
  if (!ok) throw TransferError("HMAC-SHA256 failed in OpenSSL");
}

void copy_padded(char* field, size_t cap, const std::string& text) {
  std::memset(field, 0, cap);
  std::memcpy(field, text.data(), std::min(text.size(), cap - 1));
}

void refuse(const Socket& s, wire::HandshakeStatus status, const std::string& reason) {
  wire::Result result;
  result.status = status;
  copy_padded(result.reason, wire::kReasonBytes, reason);
  uint8_t buf[wire::Result::kSize];
  result.encode(buf);
  try {
    s.send_all(buf, sizeof(buf));
  } catch (const TransferError&) {
    // The client is already gone; the refusal below is what matters.
  }
  throw TransferError(std::string("refused connection: ") + reason);
}

}  // namespace

void random_bytes(void* out, size_t n) {
  if (RAND_bytes(static_cast<uint8_t*>(out), static_cast<int>(n)) != 1) throw TransferError("RAND_bytes failed");
}

ClientHello accept_handshake(const Socket& s, const HandshakeConfig& cfg,
                             const std::optional<uint64_t>& certified_client_id) {
  // One deadline for the whole exchange: a client that trickles bytes cannot hold the
  // connection (and its thread) longer than timeout_s.
  const int64_t deadline = now_ns() + static_cast<int64_t>(cfg.timeout_s * 1e9);
  s.set_timeouts(cfg.timeout_s, cfg.timeout_s);
  uint8_t hello_bytes[wire::Hello::kSize];
  s.recv_all_before(hello_bytes, sizeof(hello_bytes), deadline);
  wire::Hello hello;
  if (!hello.decode(hello_bytes)) throw TransferError("refused connection: malformed hello");

  wire::Challenge challenge;
  challenge.auth_required = cfg.has_token ? 1 : 0;
  random_bytes(challenge.nonce, wire::kNonceBytes);
  uint8_t challenge_bytes[wire::Challenge::kSize];
  challenge.encode(challenge_bytes);
  s.send_all(challenge_bytes, sizeof(challenge_bytes));

  wire::Proof proof;
  s.recv_all_before(proof.mac, wire::kMacBytes, deadline);
  if (hello.version != wire::kVersion)
    refuse(s, wire::HandshakeStatus::kVersionMismatch,
           "protocol version " + std::to_string(hello.version) + ", engine speaks " + std::to_string(wire::kVersion));
  wire::Result result;
  if (cfg.has_token) {
    Mac expected;
    transcript_mac(cfg.token, "pddcore client proof", hello, challenge, std::nullopt, expected);
    if (CRYPTO_memcmp(expected, proof.mac, wire::kMacBytes) != 0)
      refuse(s, wire::HandshakeStatus::kBadToken, wire::to_string(wire::HandshakeStatus::kBadToken));
  }
  if (certified_client_id && hello.engine_id != *certified_client_id)
    refuse(s, wire::HandshakeStatus::kWrongEngineId, wire::to_string(wire::HandshakeStatus::kWrongEngineId));
  result.engine_id = cfg.engine_id;
  if (cfg.has_token) transcript_mac(cfg.token, "pddcore server proof", hello, challenge, result.engine_id, result.mac);
  uint8_t result_bytes[wire::Result::kSize];
  result.encode(result_bytes);
  s.send_all(result_bytes, sizeof(result_bytes));
  return {hello.kind, hello.stream, hello.engine_id, wire::padded_string(hello.address, wire::kAddressBytes)};
}

uint64_t dial_handshake(const Socket& s, const HandshakeConfig& cfg, wire::ConnKind kind, uint8_t stream,
                        const std::optional<uint64_t>& certified_server_id) {
  const int64_t deadline = now_ns() + static_cast<int64_t>(cfg.timeout_s * 1e9);
  s.set_timeouts(cfg.timeout_s, cfg.timeout_s);
  wire::Hello hello;
  hello.kind = kind;
  hello.stream = stream;
  hello.engine_id = cfg.engine_id;
  random_bytes(hello.nonce, wire::kNonceBytes);
  copy_padded(hello.address, wire::kAddressBytes, cfg.address);
  uint8_t hello_bytes[wire::Hello::kSize];
  hello.encode(hello_bytes);
  s.send_all(hello_bytes, sizeof(hello_bytes));

  uint8_t challenge_bytes[wire::Challenge::kSize];
  s.recv_all_before(challenge_bytes, sizeof(challenge_bytes), deadline);
  wire::Challenge challenge;
  if (!challenge.decode(challenge_bytes)) throw TransferError("peer is not a pddcore engine (bad challenge magic or flag)");
  if (challenge.version != wire::kVersion)
    throw TransferError("peer speaks protocol version " + std::to_string(challenge.version) + ", this engine " +
                        std::to_string(wire::kVersion));
  // With a token, the server must prove it too: a peer that waives authentication would
  // otherwise receive our messages and data (a downgrade).
  if (cfg.has_token && !challenge.auth_required)
    throw TransferError("peer does not require authentication but this engine has an auth token: refused "
                        "(a server must prove the token)");
  wire::Proof proof;
  if (cfg.has_token) transcript_mac(cfg.token, "pddcore client proof", hello, challenge, std::nullopt, proof.mac);
  s.send_all(proof.mac, wire::kMacBytes);

  uint8_t result_bytes[wire::Result::kSize];
  s.recv_all_before(result_bytes, sizeof(result_bytes), deadline);
  wire::Result result;
  result.decode(result_bytes);
  if (result.status != wire::HandshakeStatus::kOk)
    throw TransferError(std::string("peer refused the connection: ") +
                        wire::padded_string(result.reason, wire::kReasonBytes));
  if (cfg.has_token) {
    Mac expected;
    transcript_mac(cfg.token, "pddcore server proof", hello, challenge, result.engine_id, expected);
    if (CRYPTO_memcmp(expected, result.mac, wire::kMacBytes) != 0)
      throw TransferError("peer failed to prove knowledge of the auth token");
  }
  if (certified_server_id && result.engine_id != *certified_server_id)
    throw TransferError("peer states an engine id its certificate does not name");
  return result.engine_id;
}

}  // namespace pddcore::transfer
