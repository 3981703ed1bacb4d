// Fuzzes the data connection's fixed-size headers in csrc/include/pddcore/wire.h:
// ChunkHeader::decode (what a sender's chunk claims, before its payload is written into a
// registered region) and Ack::decode (a receiver's verdict on a chunk). Each decodes from a
// buffer of exactly its size, so a read past it is an ASan report. A header must be
// accepted exactly when its fields, read here, are valid, and then encode back to the same
// bytes (so no field is read from the wrong place).
#include <vector>

#include "peer_bytes.h"
#include "pddcore/wire.h"

namespace {

namespace wire = pddcore::wire;

void chunk_header(const uint8_t* data) {
  const std::vector<uint8_t> in(data, data + wire::ChunkHeader::kSize);
  wire::ChunkHeader header;
  const wire::AckStatus status = header.decode(in.data());
  const bool well_formed = fuzz::le(data, 4) == 0x43444450 && fuzz::le(data + 4, 2) == 4 &&
                           (fuzz::le(data + 6, 2) & ~uint64_t{1}) == 0 &&
                           fuzz::le(data + 44, 4) == fuzz::crc32c_bitwise(data, 44);
  const bool fits = fuzz::le(data + 32, 4) <= (64u << 20);
  FUZZ_CHECK(status == (!well_formed ? wire::AckStatus::kBadHeader
                                     : fits ? wire::AckStatus::kOk : wire::AckStatus::kTooLarge));
  if (status != wire::AckStatus::kOk) return;
  FUZZ_CHECK(header.seq == fuzz::le(data + 8, 8) && header.region_id == fuzz::le(data + 16, 8));
  FUZZ_CHECK(header.offset == fuzz::le(data + 24, 8) && header.length == fuzz::le(data + 32, 4));
  FUZZ_CHECK(header.payload_crc == fuzz::le(data + 36, 4) && header.transfer_tag == fuzz::le(data + 40, 4));
  std::vector<uint8_t> again(wire::ChunkHeader::kSize);
  header.encode(again.data());
  FUZZ_CHECK(again == in);
}

void ack(const uint8_t* data) {
  const std::vector<uint8_t> in(data, data + wire::Ack::kSize);
  wire::Ack ack;
  const bool accepted = ack.decode(in.data());
  FUZZ_CHECK(accepted == (fuzz::le(data, 4) == 0x41444450 && data[4] <= 7));
  if (!accepted) return;
  FUZZ_CHECK(static_cast<uint8_t>(ack.status) == data[4] && ack.seq == fuzz::le(data + 8, 8));
  std::vector<uint8_t> again(wire::Ack::kSize);
  ack.encode(again.data());
  std::vector<uint8_t> reserved_zero = in;
  std::fill(reserved_zero.begin() + 5, reserved_zero.begin() + 8, 0);
  FUZZ_CHECK(again == reserved_zero);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size >= wire::ChunkHeader::kSize) chunk_header(data);
  if (size >= wire::Ack::kSize) ack(data + size - wire::Ack::kSize);
  return 0;
}
