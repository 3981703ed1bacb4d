// Fuzzes accept_handshake (csrc/transport/handshake.cpp, wire::Hello): the server's side of
// the handshake against what a client sent. The input's first byte picks the server: bit 0,
// it has an auth token; bit 1, the client's TLS certificate names engine kCertifiedId. The
// rest is the client's bytes: Hello, then Proof. The server must accept exactly a whole
// well-formed hello of this version followed by a proof, never with a token (no input can
// know the server's fresh nonce), never from another id than the certificate's; what it
// returns must be what the hello says; it must refuse with TransferError and nothing else,
// and answer with the Challenge and the Result (status) the input calls for.
#include "peer_bytes.h"
#include "transport/handshake.h"

namespace {

namespace wire = pddcore::wire;
using pddcore::transfer::TransferError;

constexpr uint64_t kServerId = 0x5E5E5E5E5E5E5E5Eull, kCertifiedId = 0xCE27CE27CE27CE27ull;
constexpr size_t kHello = 96, kProof = 32, kChallenge = 23, kResult = 137;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  pddcore::transfer::HandshakeConfig cfg;
  cfg.engine_id = kServerId;
  cfg.has_token = (data[0] & 1) != 0;
  cfg.token = "fuzz-token-with-enough-entropy-0123456789";
  cfg.timeout_s = 5;
  const std::optional<uint64_t> certified = (data[0] & 2) ? std::optional<uint64_t>(kCertifiedId) : std::nullopt;
  const uint8_t* client = data + 1;
  const size_t n = size - 1;

  const bool hello_ok = n >= kHello && fuzz::le(client, 4) == 0x48444450 && client[6] <= 2;
  const bool proof_sent = hello_ok && n >= kHello + kProof;
  const bool version_ok = hello_ok && fuzz::le(client + 4, 2) == 4;
  const bool id_ok = hello_ok && (!certified || fuzz::le(client + 8, 8) == kCertifiedId);

  fuzz::PeerBytes peer(client, n);
  std::optional<pddcore::transfer::ClientHello> accepted;
  try {
    accepted = pddcore::transfer::accept_handshake(peer.socket, cfg, certified);
  } catch (const TransferError&) {
  }
  const std::string replies = peer.replies();
  const auto* reply = reinterpret_cast<const uint8_t*>(replies.data());

  FUZZ_CHECK(accepted.has_value() == (proof_sent && version_ok && !cfg.has_token && id_ok));
  if (accepted) {
    FUZZ_CHECK(static_cast<uint8_t>(accepted->kind) == client[6] && accepted->stream == client[7]);
    FUZZ_CHECK(accepted->engine_id == fuzz::le(client + 8, 8));
    const char* address = reinterpret_cast<const char*>(client + 32);
    FUZZ_CHECK(accepted->address == std::string(address, std::find(address, address + 64, '\0')));
  }
  if (!hello_ok) {
    FUZZ_CHECK(replies.empty());
    return 0;
  }
  // The challenge: magic, version, whether a proof is required.
  FUZZ_CHECK(replies.size() >= kChallenge && fuzz::le(reply, 4) == 0x48444450 && fuzz::le(reply + 4, 2) == 4);
  FUZZ_CHECK(reply[6] == (cfg.has_token ? 1 : 0));
  if (!proof_sent) {
    FUZZ_CHECK(replies.size() == kChallenge);
    return 0;
  }
  FUZZ_CHECK(replies.size() == kChallenge + kResult);
  const uint8_t* result = reply + kChallenge;
  const uint8_t status = !version_ok ? 1 : cfg.has_token ? 2 : !id_ok ? 4 : 0;
  FUZZ_CHECK(result[0] == status);
  FUZZ_CHECK(fuzz::le(result + 1, 8) == (status == 0 ? kServerId : 0));
  return 0;
}
