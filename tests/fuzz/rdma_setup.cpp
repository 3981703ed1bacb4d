// Fuzzes the RDMA backend's setup connection (csrc/transport/rdma/rdma_wire.h read through
// framing.h's recv_frame): the input is what a peer sent, frame after frame, as
// RdmaBackend::serve reads it. Each frame returned must be the one the input holds at that
// place (header fields read here); a QP list (kQpRequest, kQpReply) must decode exactly when
// its count and size agree, it holds 1 to 16 QPs and each has_gid is a flag, and then
// encode back to the same bytes; a region query or key must decode to the fields the bytes
// hold. The parser refuses with TransferError and nothing else, exactly where the input
// holds no whole frame.
#include "peer_bytes.h"
#include "transport/framing.h"
#include "transport/rdma/rdma_wire.h"

namespace {

namespace setup = pddcore::rdma::setup;

constexpr size_t kHeaderBytes = 12, kQpBytes = 28;

bool whole_frame_at(const uint8_t* p, size_t n) {
  return n >= kHeaderBytes && fuzz::le(p, 4) == 0x52444450 && p[4] >= 1 && p[4] <= 6 &&
         fuzz::le(p + 8, 4) <= (1u << 16) && n - kHeaderBytes >= fuzz::le(p + 8, 4);
}

void check_qps(const std::string& payload) {
  const auto* p = reinterpret_cast<const uint8_t*>(payload.data());
  const uint64_t count = payload.size() >= 4 ? fuzz::le(p, 4) : 0;
  bool valid = count >= 1 && count <= 16 && payload.size() == 4 + count * kQpBytes;
  for (uint64_t i = 0; valid && i < count; ++i) valid = p[4 + i * kQpBytes + 3] <= 1;
  const std::vector<setup::QpAttributes> qps = setup::decode_qps(payload);
  FUZZ_CHECK(qps.empty() == !valid);
  if (valid) FUZZ_CHECK(setup::encode_qps(qps) == payload);
}

void check_region_key(const std::string& payload) {
  if (payload.size() != setup::RegionKey::kSize) return;
  const auto* p = reinterpret_cast<const uint8_t*>(payload.data());
  setup::RegionKey key;
  key.decode(p);
  FUZZ_CHECK(static_cast<uint8_t>(key.status) == p[0] && key.region_id == fuzz::le(p + 4, 8));
  FUZZ_CHECK(key.address == fuzz::le(p + 12, 8) && key.rkey == fuzz::le(p + 20, 4) && key.size == fuzz::le(p + 24, 8));
}

void check_region_query(const std::string& payload) {
  if (payload.size() != setup::RegionQuery::kSize) return;
  const auto* p = reinterpret_cast<const uint8_t*>(payload.data());
  setup::RegionQuery query;
  query.decode(p);
  FUZZ_CHECK(query.region_id == fuzz::le(p, 8) && query.offset == fuzz::le(p + 8, 8) &&
             query.length == fuzz::le(p + 16, 8));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::PeerBytes peer(data, size);
  for (size_t at = 0;;) {
    const bool expected = whole_frame_at(data + at, size - at);
    setup::Header header;
    std::string payload;
    try {
      pddcore::transfer::recv_frame(peer.socket, &header, &payload, "RDMA setup frame");
    } catch (const pddcore::transfer::TransferError&) {
      FUZZ_CHECK(!expected);
      return 0;
    }
    FUZZ_CHECK(expected && static_cast<uint8_t>(header.type) == data[at + 4]);
    FUZZ_CHECK(payload == std::string(reinterpret_cast<const char*>(data + at + kHeaderBytes), header.length));
    if (header.type == setup::Type::kQpRequest || header.type == setup::Type::kQpReply) check_qps(payload);
    if (header.type == setup::Type::kRegionQuery) check_region_query(payload);
    if (header.type == setup::Type::kRegionReply) check_region_key(payload);
    at += kHeaderBytes + payload.size();
  }
}
