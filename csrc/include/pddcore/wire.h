// Wire format of the pddcore transfer engine: fixed-size, little-endian frames with no
// framework dependency, so other implementations (and fuzzers) can speak it.
//
// Every connection to an engine's port starts with the same handshake:
//   client -> Hello, server -> Challenge, client -> Proof, server -> Result.
// Then, by Hello::kind:
//   data connection:    client -> ChunkHeader + payload [+ CRC trailer] ..., server -> Ack per chunk
//   control connection: both ways ControlHeader + payload (messages, notifications, pings)
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

#include "pddcore/crc32c.h"

namespace pddcore::wire {

// 2: chunks carry their transfer's tag (cancel fences); 3: a fence is answered busy while a
// chunk of it is still being written; 4: the server's engine id moved from the Challenge to
// the Result (only a client that passed the handshake learns it), and a hello whose engine
// id its TLS certificate does not name is refused
constexpr uint16_t kVersion = 4;
constexpr uint32_t kHelloMagic = 0x48444450;    // "PDDH"
constexpr uint32_t kChunkMagic = 0x43444450;    // "PDDC"
constexpr uint32_t kAckMagic = 0x41444450;      // "PDDA"
constexpr uint32_t kControlMagic = 0x4D444450;  // "PDDM"

constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;      // HMAC-SHA256
constexpr size_t kAddressBytes = 64;  // "host:port", NUL padded
constexpr size_t kReasonBytes = 96;   // why a handshake was refused, NUL padded
// Upper bound on one chunk's payload and on one control payload: a receiver never
// buffers more than this for a frame it rejects.
constexpr uint32_t kMaxChunkBytes = 64u << 20;
constexpr uint32_t kMaxControlBytes = 16u << 20;

// kRdmaSetup: the RDMA backend's QP and region-key exchange (csrc/transport/rdma/rdma_wire.h).
enum class ConnKind : uint8_t { kControl = 0, kData = 1, kRdmaSetup = 2 };

enum class HandshakeStatus : uint8_t {
  kOk = 0,
  kVersionMismatch = 1,
  kBadToken = 2,
  kBadHello = 3,
  kWrongEngineId = 4,  // the hello's engine id is not the one the client's certificate names
};

// Why a receiver rejected a chunk; sent back in the Ack.
enum class AckStatus : uint8_t {
  kOk = 0,
  kBadCrc = 1,         // payload CRC32C mismatch: the sender may resend
  kUnknownRegion = 2,  // no registered region with that id
  kOutOfBounds = 3,    // offset + length outside the region
  kBadHeader = 4,      // bad magic, version or header CRC: the connection is closed
  kTooLarge = 5,       // length above kMaxChunkBytes: the connection is closed
  kNotATarget = 6,     // the region was registered as a source: no peer may write into it
  kFenced = 7,         // a chunk of a transfer its sender cancelled: dropped unwritten
};

enum class ControlType : uint8_t {
  kMessage = 1,      // a priority-lane message from the client engine
  kNotify = 2,       // the notify payload of a write whose every byte was applied
  kPing = 3,         // payload: 8-byte sender timestamp, echoed in kPong
  kPong = 4,
  kRegionQuery = 5,  // asks for the server's registered regions
  kRegionList = 6,   // reply: RegionEntry[]
  kFence = 7,        // payload: u32 transfer tag the client cancelled; drop its chunks from now on
  kFenceAck = 8,     // reply, same payload: fenced, and no chunk of it is being written any more
  kFenceBusy = 9,    // reply, same payload: fenced, but a chunk of it was still being written when
                     // the server's timeout passed; not confirmed, the client asks again
};

inline const char* to_string(AckStatus s) {
  switch (s) {
    case AckStatus::kOk: return "ok";
    case AckStatus::kBadCrc: return "CRC32C mismatch";
    case AckStatus::kUnknownRegion: return "unknown destination region";
    case AckStatus::kOutOfBounds: return "write out of bounds of the destination region";
    case AckStatus::kBadHeader: return "malformed chunk header";
    case AckStatus::kTooLarge: return "chunk larger than the protocol limit";
    case AckStatus::kNotATarget: return "destination region is registered as a source, not as a write target";
    case AckStatus::kFenced: return "chunk of a cancelled transfer";
  }
  return "unknown status";
}

inline const char* to_string(HandshakeStatus s) {
  switch (s) {
    case HandshakeStatus::kOk: return "ok";
    case HandshakeStatus::kVersionMismatch: return "protocol version mismatch";
    case HandshakeStatus::kBadToken: return "authentication failed (wrong or missing auth token)";
    case HandshakeStatus::kBadHello: return "malformed hello";
    case HandshakeStatus::kWrongEngineId: return "engine id is not the one the client's certificate names";
  }
  return "unknown status";
}

// Little-endian field access (x86 and aarch64 hosts are little-endian; memcpy keeps
// the access alignment-safe).
class Writer {
 public:
  explicit Writer(uint8_t* p) : p_(p) {}
  template <typename T>
  Writer& put(T v) {
    std::memcpy(p_ + n_, &v, sizeof(T));
    n_ += sizeof(T);
    return *this;
  }
  Writer& bytes(const void* src, size_t len) {
    std::memcpy(p_ + n_, src, len);
    n_ += len;
    return *this;
  }
  size_t size() const { return n_; }

 private:
  uint8_t* p_;
  size_t n_ = 0;
};

class Reader {
 public:
  explicit Reader(const uint8_t* p) : p_(p) {}
  template <typename T>
  T get() {
    T v;
    std::memcpy(&v, p_ + n_, sizeof(T));
    n_ += sizeof(T);
    return v;
  }
  void bytes(void* dst, size_t len) {
    std::memcpy(dst, p_ + n_, len);
    n_ += len;
  }

 private:
  const uint8_t* p_;
  size_t n_ = 0;
};

inline std::string padded_string(const char* field, size_t cap) { return std::string(field, strnlen(field, cap)); }

struct Hello {
  static constexpr size_t kSize = 4 + 2 + 1 + 1 + 8 + kNonceBytes + kAddressBytes;
  uint16_t version = kVersion;
  ConnKind kind = ConnKind::kControl;
  uint8_t stream = 0;
  uint64_t engine_id = 0;
  uint8_t nonce[kNonceBytes] = {};
  char address[kAddressBytes] = {};  // the client engine's own listen address

  void encode(uint8_t* out) const {
    Writer(out).put(kHelloMagic).put(version).put(static_cast<uint8_t>(kind)).put(stream).put(engine_id)
        .bytes(nonce, kNonceBytes).bytes(address, kAddressBytes);
  }
  // False on a bad magic or an unknown connection kind.
  bool decode(const uint8_t* in) {
    Reader r(in);
    if (r.get<uint32_t>() != kHelloMagic) return false;
    version = r.get<uint16_t>();
    const uint8_t k = r.get<uint8_t>();
    if (k > static_cast<uint8_t>(ConnKind::kRdmaSetup)) return false;
    kind = static_cast<ConnKind>(k);
    stream = r.get<uint8_t>();
    engine_id = r.get<uint64_t>();
    r.bytes(nonce, kNonceBytes);
    r.bytes(address, kAddressBytes);
    return true;
  }
};

// Sent before the client proved anything: it names no engine.
struct Challenge {
  static constexpr size_t kSize = 4 + 2 + 1 + kNonceBytes;
  uint16_t version = kVersion;
  uint8_t auth_required = 0;
  uint8_t nonce[kNonceBytes] = {};

  void encode(uint8_t* out) const {
    Writer(out).put(kHelloMagic).put(version).put(auth_required).bytes(nonce, kNonceBytes);
  }
  // False on a bad magic or an auth_required byte other than 0 or 1.
  bool decode(const uint8_t* in) {
    Reader r(in);
    if (r.get<uint32_t>() != kHelloMagic) return false;
    version = r.get<uint16_t>();
    auth_required = r.get<uint8_t>();
    r.bytes(nonce, kNonceBytes);
    return auth_required <= 1;
  }
};

// Client's answer to the challenge: HMAC-SHA256(token, transcript) or zeros without a token.
struct Proof {
  static constexpr size_t kSize = kMacBytes;
  uint8_t mac[kMacBytes] = {};
};

// Server's verdict; on success, the server's engine id, and with a token a mac proving the
// server knows the token too (over the transcript and that engine id).
struct Result {
  static constexpr size_t kSize = 1 + 8 + kMacBytes + kReasonBytes;
  HandshakeStatus status = HandshakeStatus::kOk;
  uint64_t engine_id = 0;  // 0 on a refusal
  uint8_t mac[kMacBytes] = {};
  char reason[kReasonBytes] = {};

  void encode(uint8_t* out) const {
    Writer(out).put(static_cast<uint8_t>(status)).put(engine_id).bytes(mac, kMacBytes).bytes(reason, kReasonBytes);
  }
  void decode(const uint8_t* in) {
    Reader r(in);
    status = static_cast<HandshakeStatus>(r.get<uint8_t>());
    engine_id = r.get<uint64_t>();
    r.bytes(mac, kMacBytes);
    r.bytes(reason, kReasonBytes);
  }
};

// Precedes each chunk payload on a data connection. The payload goes straight into
// the destination region; payload_crc covers it, header_crc covers the fields before it.
// With kCrcTrailer in flags, payload_crc is 0 and the payload's CRC32C follows the
// payload (4 bytes): a sender can then checksum each slice just before it leaves, while
// the slice is still in cache, instead of reading the whole chunk twice. With kWarmup the
// payload is padding that brings a fresh connection out of slow start before any data is
// queued, its CRC32C in the header (never a trailer): the receiver checks and drops it (no
// region, no transfer) and acks it.
struct ChunkHeader {
  static constexpr uint16_t kCrcTrailer = 1;
  static constexpr uint16_t kWarmup = 2;
  static constexpr size_t kTrailerSize = 4;
  static constexpr size_t kSize = 48;
  static constexpr size_t kCrcCovered = 44;
  uint16_t version = kVersion;
  uint16_t flags = 0;
  uint64_t seq = 0;  // sender-chosen, echoed in the Ack
  uint64_t region_id = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
  uint32_t payload_crc = 0;
  uint32_t transfer_tag = 0;  // the sender's unpredictable tag of its transfer: what a cancel fences

  void encode(uint8_t* out) const {
    Writer w(out);
    w.put(kChunkMagic).put(version).put(flags).put(seq).put(region_id).put(offset).put(length).put(payload_crc);
    w.put(transfer_tag).put(crc32c(out, kCrcCovered));
  }
  // kOk, kBadHeader (magic, version or header CRC) or kTooLarge.
  AckStatus decode(const uint8_t* in) {
    Reader r(in);
    const uint32_t magic = r.get<uint32_t>();
    version = r.get<uint16_t>();
    flags = r.get<uint16_t>();
    seq = r.get<uint64_t>();
    region_id = r.get<uint64_t>();
    offset = r.get<uint64_t>();
    length = r.get<uint32_t>();
    payload_crc = r.get<uint32_t>();
    transfer_tag = r.get<uint32_t>();
    const uint32_t header_crc = r.get<uint32_t>();
    if (magic != kChunkMagic || version != kVersion || header_crc != crc32c(in, kCrcCovered) ||
        (flags & ~(kCrcTrailer | kWarmup)) != 0 || flags == (kCrcTrailer | kWarmup))
      return AckStatus::kBadHeader;
    if (length > kMaxChunkBytes) return AckStatus::kTooLarge;
    return AckStatus::kOk;
  }
};

struct Ack {
  static constexpr size_t kSize = 16;
  AckStatus status = AckStatus::kOk;
  uint64_t seq = 0;

  void encode(uint8_t* out) const {
    Writer(out).put(kAckMagic).put(static_cast<uint8_t>(status)).put(uint8_t{0}).put(uint16_t{0}).put(seq);
  }
  bool decode(const uint8_t* in) {
    Reader r(in);
    if (r.get<uint32_t>() != kAckMagic) return false;
    const uint8_t s = r.get<uint8_t>();
    if (s > static_cast<uint8_t>(AckStatus::kFenced)) return false;
    status = static_cast<AckStatus>(s);
    r.get<uint8_t>();
    r.get<uint16_t>();
    seq = r.get<uint64_t>();
    return true;
  }
};

// Precedes each control payload; crc covers the payload.
struct ControlHeader {
  static constexpr size_t kSize = 16;
  ControlType type = ControlType::kMessage;
  uint32_t length = 0;
  uint32_t crc = 0;

  void encode(uint8_t* out) const {
    Writer(out).put(kControlMagic).put(static_cast<uint8_t>(type)).put(uint8_t{0}).put(uint16_t{0}).put(length).put(crc);
  }
  bool decode(const uint8_t* in) {
    Reader r(in);
    if (r.get<uint32_t>() != kControlMagic) return false;
    const uint8_t t = r.get<uint8_t>();
    if (t < static_cast<uint8_t>(ControlType::kMessage) || t > static_cast<uint8_t>(ControlType::kFenceBusy))
      return false;
    type = static_cast<ControlType>(t);
    r.get<uint8_t>();
    r.get<uint16_t>();
    length = r.get<uint32_t>();
    crc = r.get<uint32_t>();
    return length <= kMaxControlBytes;
  }
};

// One registered region as listed in a kRegionList reply.
// One write target of an engine (sources are never listed): what a pointer-addressed
// adapter needs to write into it.
struct RegionEntry {
  static constexpr size_t kSize = 24;
  uint64_t region_id = 0;
  uint64_t base_address = 0;  // the owner's virtual address if it chose to list it, else 0
  uint64_t size = 0;
};

}  // namespace pddcore::wire
