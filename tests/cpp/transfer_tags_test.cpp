// TransferTags: a keyed permutation of transfer numbers, so tags never repeat and do not
// follow from one another. Built and run by tests/test_transfer_security.py;
// `transfer_tags_test <case>`, exit 0 on success.
#include "transport/transfer_tags.h"

#include <cstdint>
#include <vector>

#include "check.h"

using pddcore::transfer::TransferTags;

namespace {

constexpr uint64_t kKeys[4] = {0x243F6A8885A308D3ull, 0x13198A2E03707344ull, 0xA4093822299F31D0ull,
                               0x082EFA98EC4E6C89ull};
constexpr uint64_t kOtherKeys[4] = {0x452821E638D01377ull, 0xBE5466CF34E90C6Cull, 0xC0AC29B7C97C50DDull,
                                    0x3F84D5B5B5470917ull};
constexpr uint32_t kCount = 1u << 22;

// No two of the first kCount transfers share a tag (a bitmap over all 2^32 tags).
void distinct_tags() {
  const TransferTags tags(kKeys);
  std::vector<uint64_t> seen(1u << 26, 0);
  for (uint32_t i = 0; i < kCount; ++i) {
    const uint32_t t = tags.tag(i);
    CHECK((seen[t >> 6] >> (t & 63) & 1) == 0);
    seen[t >> 6] |= 1ull << (t & 63);
  }
}

// A tag says nothing of the next: consecutive tags differ by a step that itself varies, and
// about half the bits change between neighbours, as for random numbers.
void neighbours_look_random() {
  const TransferTags tags(kKeys);
  uint64_t changed_bits = 0, same_step = 0;
  for (uint32_t i = 1; i + 1 < kCount; ++i) {
    const uint32_t a = tags.tag(i - 1), b = tags.tag(i), c = tags.tag(i + 1);
    changed_bits += __builtin_popcount(a ^ b);
    same_step += (b - a) == (c - b);
  }
  const double mean = static_cast<double>(changed_bits) / (kCount - 2);
  CHECK(mean > 15.9 && mean < 16.1);
  CHECK(same_step < 16);
}

// Another engine's keys give other tags: it cannot reproduce this engine's sequence.
void keys_decide_every_tag() {
  const TransferTags tags(kKeys), other(kOtherKeys);
  uint32_t equal = 0;
  for (uint32_t i = 0; i < kCount; ++i) equal += tags.tag(i) == other.tag(i);
  CHECK(equal < 16);
}

}  // namespace

int main(int argc, char** argv) {
  return run_case_main(argc, argv,
                       {{"distinct_tags", distinct_tags},
                        {"neighbours_look_random", neighbours_look_random},
                        {"keys_decide_every_tag", keys_decide_every_tag}});
}
