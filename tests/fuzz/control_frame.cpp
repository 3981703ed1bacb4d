// Fuzzes recv_control_frame (csrc/transport/control_frames.cpp over framing.h and
// wire::ControlHeader): the input is what a peer sent on a control connection, read as the
// engine's serve_control reads it, frame after frame. Each frame returned must be the one the
// input holds at that place (its header read here, its CRC32C computed bit by bit); the
// parser must refuse, with TransferError and nothing else, exactly where the input holds no
// whole, intact frame.

#include "peer_bytes.h"
#include "transport/control_frames.h"

namespace {

namespace wire = pddcore::wire;

struct Frame {
  uint8_t type;
  std::string payload;
};

constexpr size_t kHeaderBytes = 16;

// The frame at the start of `p`, or nothing when the bytes are not a whole, intact frame.
std::optional<Frame> frame_at(const uint8_t* p, size_t n) {
  if (n < kHeaderBytes || fuzz::le(p, 4) != 0x4D444450) return std::nullopt;  // "PDDM"
  const uint8_t type = p[4];
  const uint64_t length = fuzz::le(p + 8, 4), crc = fuzz::le(p + 12, 4);
  if (type < 1 || type > 9 || length > (16u << 20) || n - kHeaderBytes < length) return std::nullopt;
  if (fuzz::crc32c_bitwise(p + kHeaderBytes, length) != crc) return std::nullopt;
  return Frame{type, std::string(reinterpret_cast<const char*>(p + kHeaderBytes), length)};
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::PeerBytes peer(data, size);
  for (size_t at = 0;;) {
    const std::optional<Frame> expected = frame_at(data + at, size - at);
    wire::ControlType type;
    std::string payload;
    try {
      FUZZ_CHECK(pddcore::transfer::recv_control_frame(peer.socket, &type, &payload, /*idle_ok=*/true));
    } catch (const pddcore::transfer::TransferError&) {
      FUZZ_CHECK(!expected);
      return 0;
    }
    FUZZ_CHECK(expected && expected->type == static_cast<uint8_t>(type) && expected->payload == payload);
    at += kHeaderBytes + payload.size();
  }
}
