// Fuzzes dial_handshake (csrc/transport/handshake.cpp, wire::Challenge and wire::Result): the
// client's side of the handshake against what a server sent. The input's first byte picks
// the client: bit 0, it has an auth token; bit 1, the server's TLS certificate names engine
// kCertifiedId. The rest is the server's bytes: Challenge, then Result. The client must
// accept exactly a well-formed challenge of this version followed by a whole Result of
// status ok, never with a token (no input can know the client's fresh nonce), never an id
// the certificate does not name, and return the Result's engine id; it must refuse with
// TransferError and nothing else, having sent its Hello and, past a good challenge, a Proof.
#include "peer_bytes.h"
#include "transport/handshake.h"

namespace {

namespace wire = pddcore::wire;
using pddcore::transfer::TransferError;

constexpr uint64_t kClientId = 0xC1C1C1C1C1C1C1C1ull, kCertifiedId = 0xCE27CE27CE27CE27ull;
constexpr size_t kHello = 96, kProof = 32, kChallenge = 23, kResult = 137;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  pddcore::transfer::HandshakeConfig cfg;
  cfg.engine_id = kClientId;
  cfg.address = "127.0.0.1:4242";
  cfg.has_token = (data[0] & 1) != 0;
  cfg.token = "fuzz-token-with-enough-entropy-0123456789";
  cfg.timeout_s = 5;
  const std::optional<uint64_t> certified = (data[0] & 2) ? std::optional<uint64_t>(kCertifiedId) : std::nullopt;
  const uint8_t* server = data + 1;
  const size_t n = size - 1;

  const bool challenge_ok = n >= kChallenge && fuzz::le(server, 4) == 0x48444450 && fuzz::le(server + 4, 2) == 4 &&
                            server[6] <= 1 && !(cfg.has_token && server[6] == 0);
  const uint8_t* result = server + kChallenge;
  const bool result_ok = challenge_ok && n >= kChallenge + kResult && result[0] == 0 && !cfg.has_token &&
                         (!certified || fuzz::le(result + 1, 8) == kCertifiedId);

  fuzz::PeerBytes peer(server, n);
  std::optional<uint64_t> server_id;
  try {
    server_id = pddcore::transfer::dial_handshake(peer.socket, cfg, wire::ConnKind::kData, 3, certified);
  } catch (const TransferError&) {
  }
  const std::string replies = peer.replies();
  const auto* hello = reinterpret_cast<const uint8_t*>(replies.data());

  FUZZ_CHECK(server_id.has_value() == result_ok);
  if (server_id) FUZZ_CHECK(*server_id == fuzz::le(result + 1, 8));
  FUZZ_CHECK(replies.size() == kHello + (challenge_ok ? kProof : 0));
  FUZZ_CHECK(fuzz::le(hello, 4) == 0x48444450 && fuzz::le(hello + 4, 2) == 4 && hello[6] == 1 && hello[7] == 3);
  FUZZ_CHECK(fuzz::le(hello + 8, 8) == kClientId && std::string(reinterpret_cast<const char*>(hello + 32)) == cfg.address);
  return 0;
}
