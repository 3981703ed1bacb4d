// The RDMA backend's setup protocol, spoken on one authenticated engine connection per
// peer (the engine's handshake runs first, so only a peer that knows the token gets QPs or
// rkeys). Frames are SetupHeader + payload, little-endian:
//   client -> kQpRequest (its QPs' attributes)      server -> kQpReply (its own QPs), or kError
//   client -> kRegionQuery (region id, offset, length of a first write into it)
//                                                   server -> kRegionReply (status, address, rkey, size)
//   client -> kQpRetire (server QPNs to destroy, after they failed; no reply)
// A kQpRequest adds QPs; closing the connection destroys all of the server's QPs for it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pddcore/wire.h"

namespace pddcore::rdma::setup {

constexpr uint32_t kMagic = 0x52444450;  // "PDDR"
constexpr uint32_t kMaxPayload = 1u << 16;
constexpr uint32_t kMaxQps = 16;

enum class Type : uint8_t { kQpRequest = 1, kQpReply = 2, kRegionQuery = 3, kRegionReply = 4, kError = 5, kQpRetire = 6 };

struct Header {
  static constexpr size_t kSize = 12;
  Type type = Type::kError;
  uint32_t length = 0;

  void encode(uint8_t* out) const {
    wire::Writer(out).put(kMagic).put(static_cast<uint8_t>(type)).put(uint8_t{0}).put(uint16_t{0}).put(length);
  }
  bool decode(const uint8_t* in) {
    wire::Reader r(in);
    if (r.get<uint32_t>() != kMagic) return false;
    const uint8_t t = r.get<uint8_t>();
    if (t < static_cast<uint8_t>(Type::kQpRequest) || t > static_cast<uint8_t>(Type::kQpRetire)) return false;
    type = static_cast<Type>(t);
    r.get<uint8_t>();
    r.get<uint16_t>();
    length = r.get<uint32_t>();
    return length <= kMaxPayload;
  }
};

// What a peer needs to connect to one QP: its address (LID, and GID for routed or RoCE
// fabrics), QP number, first packet sequence number, and the port's active MTU.
struct QpAttributes {
  static constexpr size_t kSize = 28;
  uint16_t lid = 0;
  uint8_t mtu = 0;  // enum ibv_mtu
  uint8_t has_gid = 0;
  uint32_t qpn = 0;
  uint32_t psn = 0;
  uint8_t gid[16] = {};

  void encode(uint8_t* out) const {
    wire::Writer(out).put(lid).put(mtu).put(has_gid).put(qpn).put(psn).bytes(gid, sizeof(gid));
  }
  // False when has_gid, a flag, is neither 0 nor 1.
  bool decode(const uint8_t* in) {
    wire::Reader r(in);
    lid = r.get<uint16_t>();
    mtu = r.get<uint8_t>();
    has_gid = r.get<uint8_t>();
    qpn = r.get<uint32_t>();
    psn = r.get<uint32_t>();
    r.bytes(gid, sizeof(gid));
    return has_gid <= 1;
  }
};

inline std::string encode_qps(const std::vector<QpAttributes>& qps) {
  std::string out(4 + qps.size() * QpAttributes::kSize, '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  wire::Writer(p).put(static_cast<uint32_t>(qps.size()));
  for (size_t i = 0; i < qps.size(); ++i) qps[i].encode(p + 4 + i * QpAttributes::kSize);
  return out;
}

// Empty on a malformed list.
inline std::vector<QpAttributes> decode_qps(const std::string& payload) {
  if (payload.size() < 4) return {};
  const auto* p = reinterpret_cast<const uint8_t*>(payload.data());
  const uint32_t n = wire::Reader(p).get<uint32_t>();
  if (n == 0 || n > kMaxQps || payload.size() != 4 + n * QpAttributes::kSize) return {};
  std::vector<QpAttributes> out(n);
  for (uint32_t i = 0; i < n; ++i)
    if (!out[i].decode(p + 4 + i * QpAttributes::kSize)) return {};
  return out;
}

struct RegionQuery {
  static constexpr size_t kSize = 24;
  uint64_t region_id = 0;
  uint64_t offset = 0;
  uint64_t length = 0;

  void encode(uint8_t* out) const { wire::Writer(out).put(region_id).put(offset).put(length); }
  void decode(const uint8_t* in) {
    wire::Reader r(in);
    region_id = r.get<uint64_t>();
    offset = r.get<uint64_t>();
    length = r.get<uint64_t>();
  }
};

// A registered region as a remote writer needs it, and the target's verdict on the
// queried range (kOk, kUnknownRegion: no key; kOutOfBounds: key valid, range refused).
struct RegionKey {
  static constexpr size_t kSize = 32;
  wire::AckStatus status = wire::AckStatus::kUnknownRegion;
  uint64_t region_id = 0;
  uint64_t address = 0;
  uint32_t rkey = 0;
  uint64_t size = 0;

  // The responder gave an rkey: the region exists and is a write target.
  bool known() const { return status == wire::AckStatus::kOk || status == wire::AckStatus::kOutOfBounds; }
  bool contains(uint64_t offset, uint64_t length) const { return offset <= size && length <= size - offset; }

  void encode(uint8_t* out) const {
    wire::Writer(out).put(static_cast<uint8_t>(status)).put(uint8_t{0}).put(uint16_t{0}).put(region_id).put(address)
        .put(rkey).put(size);
  }
  void decode(const uint8_t* in) {
    wire::Reader r(in);
    status = static_cast<wire::AckStatus>(r.get<uint8_t>());
    r.get<uint8_t>();
    r.get<uint16_t>();
    region_id = r.get<uint64_t>();
    address = r.get<uint64_t>();
    rkey = r.get<uint32_t>();
    size = r.get<uint64_t>();
  }
};

}  // namespace pddcore::rdma::setup
