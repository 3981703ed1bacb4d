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

#ifdef PDDCORE_CRC32C_X86
__attribute__((target("sse4.2"))) inline uint32_t crc32c_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
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
