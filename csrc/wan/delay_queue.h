// The WAN emulator's delay-line algorithm, free of any OS or framework code:
// a bounded FIFO of packets stored back to back in one byte ring (no per-packet
// allocation), and the policy that gives each arriving packet its release time
// (fixed delay, bounded order-preserving jitter) or drops it (random loss).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>

namespace pddcore::wan {

// xoshiro256** seeded through splitmix64: fast, good enough for loss and jitter draws.
class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& word : state_) {
      seed += 0x9E3779B97F4A7C15ull;
      uint64_t z = seed;
      z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
      z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
      word = z ^ (z >> 31);
    }
  }

  uint64_t next() {
    const uint64_t result = rotl(state_[1] * 5, 7) * 9;
    const uint64_t t = state_[1] << 17;
    state_[2] ^= state_[0];
    state_[3] ^= state_[1];
    state_[1] ^= state_[2];
    state_[0] ^= state_[3];
    state_[2] ^= t;
    state_[3] = rotl(state_[3], 45);
    return result;
  }

  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t state_[4];
};

// Release time of each packet: arrival + delay + U[-jitter, +jitter], but never earlier
// than the packet before it, so the link never reorders (TCP would read reordering as
// loss). Every packet's one-way delay therefore stays within [delay - jitter, delay + jitter].
class ReleasePolicy {
 public:
  ReleasePolicy(uint64_t delay_ns, uint64_t jitter_ns, double loss, uint64_t seed)
      : delay_ns_(delay_ns), jitter_ns_(jitter_ns), loss_(loss), rng_(seed) {
    if (jitter_ns > delay_ns) throw std::invalid_argument("jitter must not exceed the delay");
    if (!(loss >= 0.0 && loss < 1.0)) throw std::invalid_argument("loss must be in [0, 1)");
  }

  // True when the next packet is to be dropped.
  bool lose() { return loss_ > 0.0 && rng_.uniform() < loss_; }

  uint64_t release_at(uint64_t arrival_ns) {
    uint64_t release = arrival_ns + delay_ns_ - jitter_ns_;
    if (jitter_ns_ > 0) release += static_cast<uint64_t>(rng_.uniform() * static_cast<double>(2 * jitter_ns_));
    if (release < last_release_ns_) release = last_release_ns_;
    last_release_ns_ = release;
    return release;
  }

 private:
  uint64_t delay_ns_;
  uint64_t jitter_ns_;
  double loss_;
  Rng rng_;
  uint64_t last_release_ns_ = 0;
};

// FIFO of packets in one contiguous byte ring. A packet is read straight into the ring
// (reserve, then commit with its length), so forwarding copies nothing in user space.
// Each slot reserved is kMaxPacket bytes contiguous; the ring wraps to offset 0 when the
// tail has less than that left. Release times are non-decreasing, so FIFO order is
// release order and no timer wheel is needed.
class DelayQueue {
 public:
  static constexpr size_t kMaxPacket = 65536 + 64;  // any IP packet, plus a TUN virtio-net header

  struct Packet {
    uint64_t release_ns;
    uint32_t offset;
    uint32_t length;
  };

  // Storage is left uninitialised so untouched pages of a large ring cost no memory.
  explicit DelayQueue(size_t byte_capacity) : capacity_(byte_capacity) {
    if (byte_capacity < 2 * kMaxPacket)
      throw std::invalid_argument("delay queue needs at least " + std::to_string(2 * kMaxPacket) + " bytes");
    if (byte_capacity > (size_t{1} << 31)) throw std::invalid_argument("delay queue is limited to 2 GiB");
    slots_ = 1024;
    while (slots_ < byte_capacity / 64) slots_ <<= 1;  // 64 B: about a bare TCP ACK
    bytes_.reset(new uint8_t[capacity_]);
    packets_.reset(new Packet[slots_]);
  }

  // Room for one packet of up to kMaxPacket bytes, or nullptr when the queue is full.
  uint8_t* reserve() {
    if (count_ == slots_) return nullptr;
    if (count_ == 0) {
      tail_ = 0;
      return bytes_.get();
    }
    const size_t head = front().offset;
    if (tail_ > head) {  // data in [head, tail): free space at the end, then before head
      if (capacity_ - tail_ >= kMaxPacket) return bytes_.get() + tail_;
      if (head >= kMaxPacket) {
        tail_ = 0;
        return bytes_.get();
      }
      return nullptr;
    }
    // Wrapped: data in [head, end) and [0, tail); free space is [tail, head).
    return head - tail_ >= kMaxPacket ? bytes_.get() + tail_ : nullptr;
  }

  // Enqueues the packet written at the last reserve() address.
  void commit(uint32_t length, uint64_t release_ns) {
    packets_[(first_ + count_) & (slots_ - 1)] = {release_ns, static_cast<uint32_t>(tail_), length};
    ++count_;
    tail_ += length;
    queued_bytes_ += length;
  }

  bool empty() const { return count_ == 0; }
  const Packet& front() const { return packets_[first_]; }
  const uint8_t* data(const Packet& p) const { return bytes_.get() + p.offset; }

  void pop() {
    queued_bytes_ -= packets_[first_].length;
    first_ = (first_ + 1) & (slots_ - 1);
    --count_;
  }

  size_t packets() const { return count_; }
  size_t queued_bytes() const { return queued_bytes_; }

 private:
  size_t capacity_;
  size_t slots_;
  std::unique_ptr<uint8_t[]> bytes_;
  std::unique_ptr<Packet[]> packets_;  // power-of-two ring of descriptors
  size_t first_ = 0;
  size_t count_ = 0;
  size_t tail_ = 0;  // byte offset where the next packet goes
  size_t queued_bytes_ = 0;
};

}  // namespace pddcore::wan
