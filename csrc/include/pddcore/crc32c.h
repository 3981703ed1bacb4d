// CRC32C (Castagnoli), the checksum on every transfer chunk and handoff message.
// Uses the SSE4.2 crc32 instruction when the CPU has it, a table otherwise.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <nmmintrin.h>
#define PDDCORE_CRC32C_X86 1
#endif

namespace pddcore {
namespace detail {

inline const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[i] = c;
    }
    return t;
  }();
  return table;
}

inline uint32_t crc32c_software(uint32_t crc, const uint8_t* p, size_t n) {
  const auto& t = crc32c_table();
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

// The CRC register is linear over GF(2): running it over n zero bytes is a 32x32 bit
// matrix. Applying that matrix lets three independent streams be joined, which is what
// hides the crc32 instruction's 3-cycle latency.
using Gf2Matrix = std::array<uint32_t, 32>;  // column i: image of bit i

inline uint32_t gf2_apply(const Gf2Matrix& m, uint32_t v) {
  uint32_t r = 0;
  for (int i = 0; v != 0; ++i, v >>= 1)
    if (v & 1u) r ^= m[i];
  return r;
}

inline Gf2Matrix gf2_compose(const Gf2Matrix& a, const Gf2Matrix& b) {  // a after b
  Gf2Matrix r{};
  for (int i = 0; i < 32; ++i) r[i] = gf2_apply(a, b[i]);
  return r;
}

// Operator that advances a CRC register over `n` zero bytes.
inline Gf2Matrix crc32c_zeros_operator(size_t n) {
  Gf2Matrix bit{};  // one zero bit: shift right, fold in the polynomial
  bit[0] = 0x82F63B78u;
  for (int i = 1; i < 32; ++i) bit[i] = 1u << (i - 1);
  Gf2Matrix byte = bit;
  for (int k = 1; k < 8; ++k) byte = gf2_compose(bit, byte);
  Gf2Matrix result{};
  for (int i = 0; i < 32; ++i) result[i] = 1u << i;
  for (Gf2Matrix power = byte; n != 0; n >>= 1, power = gf2_compose(power, power))
    if (n & 1) result = gf2_compose(power, result);
  return result;
}

#ifdef PDDCORE_CRC32C_X86
constexpr size_t kCrcStripe = 4096;  // bytes per stream in one interleaved round

__attribute__((target("sse4.2"))) inline uint64_t crc32c_words(uint64_t c, const uint8_t* p, size_t n) {
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  return c;
}

__attribute__((target("sse4.2"))) inline uint32_t crc32c_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  static const Gf2Matrix shift_one = crc32c_zeros_operator(kCrcStripe);
  static const Gf2Matrix shift_two = crc32c_zeros_operator(2 * kCrcStripe);
  uint64_t c = crc;
  for (; n >= 3 * kCrcStripe; n -= 3 * kCrcStripe, p += 3 * kCrcStripe) {
    uint64_t c0 = c, c1 = 0, c2 = 0;
    for (size_t i = 0; i < kCrcStripe; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + kCrcStripe + i, 8);
      std::memcpy(&w2, p + 2 * kCrcStripe + i, 8);
      c0 = _mm_crc32_u64(c0, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    c = gf2_apply(shift_two, static_cast<uint32_t>(c0)) ^ gf2_apply(shift_one, static_cast<uint32_t>(c1)) ^
        static_cast<uint32_t>(c2);
  }
  c = crc32c_words(c, p, n);
  p += n & ~size_t{7};
  uint32_t c32 = static_cast<uint32_t>(c);
  for (n &= 7; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

inline bool cpu_has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace detail

// Continues a CRC32C over more bytes: crc32c(b, crc32c(a)) == crc32c(a + b).
inline uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#ifdef PDDCORE_CRC32C_X86
  if (detail::cpu_has_sse42()) return ~detail::crc32c_sse42(crc, p, n);
#endif
  return ~detail::crc32c_software(crc, p, n);
}

inline bool crc32c_hardware() {
#ifdef PDDCORE_CRC32C_X86
  return detail::cpu_has_sse42();
#else
  return false;
#endif
}

}  // namespace pddcore
