// Transfer tags: what a receiver fences a cancelled transfer by. Sequential tags let any
// holder of the token fence another engine's next transfers by guessing them, so each
// engine numbers its transfers through a keyed permutation of 32 bits (a four-round Feistel
// network with random round keys): a tag reveals nothing of the next one without the keys,
// and no tag repeats within 2^32 transfers, so a new transfer never meets an old fence.
#pragma once

#include <cstdint>

namespace pddcore::transfer {

class TransferTags {
 public:
  // keys: random bytes (the engine draws them with RAND_bytes).
  explicit TransferTags(const uint64_t (&keys)[4]) : keys_{keys[0], keys[1], keys[2], keys[3]} {}

  // The tag of the transfer with this sequence number.
  uint32_t tag(uint32_t sequence) const {
    uint32_t left = sequence >> 16, right = sequence & 0xFFFF;
    for (uint64_t key : keys_) {
      const uint32_t mixed = left ^ round(right, key);
      left = right;
      right = mixed;
    }
    return (left << 16) | right;
  }

 private:
  // splitmix64's finalizer over the half and the round key, folded to 16 bits.
  static uint32_t round(uint32_t half, uint64_t key) {
    uint64_t z = key + half * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return static_cast<uint32_t>(z ^ (z >> 32)) & 0xFFFF;
  }

  uint64_t keys_[4];
};

}  // namespace pddcore::transfer
