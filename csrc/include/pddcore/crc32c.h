// CRC32C (Castagnoli), the checksum on every transfer chunk and handoff message.
//
// Three implementations, the best one the CPU has picked at run time:
//   - kFold512: AVX-512 VPCLMULQDQ folding, 256 bytes per round (tens of GB/s);
//   - kSse42:   the SSE4.2 crc32 instruction over three interleaved streams;
//   - kTable:   a byte table, for CPUs with neither.
// All three give the same value; each can be asked for by name so tests cover every one.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PDDCORE_CRC32C_X86 1
#endif

namespace pddcore {

enum class Crc32cImpl { kTable, kSse42, kFold512 };
constexpr Crc32cImpl kCrc32cImpls[] = {Crc32cImpl::kTable, Crc32cImpl::kSse42, Crc32cImpl::kFold512};

namespace detail {

// The polynomial, normal form (x^32 implied) and bit-reflected (the byte order CRC32C uses).
constexpr uint32_t kCrc32cPoly = 0x1EDC6F41u;
constexpr uint32_t kCrc32cPolyReflected = 0x82F63B78u;

inline const std::array<uint32_t, 256>& crc32c_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kCrc32cPolyReflected & (0u - (c & 1u)));
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
  bit[0] = kCrc32cPolyReflected;
  for (int i = 1; i < 32; ++i) bit[i] = 1u << (i - 1);
  Gf2Matrix byte = bit;
  for (int k = 1; k < 8; ++k) byte = gf2_compose(bit, byte);
  Gf2Matrix result{};
  for (int i = 0; i < 32; ++i) result[i] = 1u << i;
  for (Gf2Matrix power = byte; n != 0; n >>= 1, power = gf2_compose(power, power))
    if (n & 1) result = gf2_compose(power, result);
  return result;
}

// x^n mod P, bit-reflected into 32 bits and shifted left by one: the form a carry-less
// multiply of bit-reflected operands needs (the product of reflected values comes out
// reflected and one bit short of the 128-bit lane).
constexpr uint64_t crc32c_fold_constant(unsigned n) {
  uint64_t r = 1;
  for (unsigned i = 0; i < n; ++i) {
    r <<= 1;
    if (r >> 32) r ^= (uint64_t{1} << 32) | kCrc32cPoly;
  }
  uint64_t reflected = 0;
  for (int i = 0; i < 32; ++i)
    if ((r >> i) & 1) reflected |= uint64_t{1} << (31 - i);
  return reflected << 1;
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

// Folding: a 128-bit lane A = H x^64 + L moved D bits further down the message is
// congruent (mod P) to H * (x^(D+32) mod P) + L * (x^(D-32) mod P) in reflected form, a
// value that fits the lane again and is XORed into the data found there. Four 512-bit
// accumulators take 256 bytes a round; at the end they fold into one, and those 64 bytes,
// congruent to everything before them, go through the crc32 instruction with the tail.
#define PDDCORE_FOLD512_TARGET __attribute__((target("avx512f,vpclmulqdq,sse4.2")))

template <unsigned Bits>
PDDCORE_FOLD512_TARGET inline __m512i crc32c_fold_by() {
  constexpr uint64_t high_half = crc32c_fold_constant(Bits + 32), low_half = crc32c_fold_constant(Bits - 32);
  return _mm512_broadcast_i32x4(_mm_set_epi64x(static_cast<long long>(low_half), static_cast<long long>(high_half)));
}

PDDCORE_FOLD512_TARGET inline __m512i crc32c_fold(__m512i acc, __m512i k, __m512i next) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(acc, k, 0x00), _mm512_clmulepi64_epi128(acc, k, 0x11),
                                   next, 0x96);  // a ^ b ^ c
}

constexpr size_t kFoldRound = 256;

PDDCORE_FOLD512_TARGET inline uint32_t crc32c_fold512(uint32_t crc, const uint8_t* p, size_t n) {
  if (n < kFoldRound) return crc32c_sse42(crc, p, n);
  // A register value c before the data equals c XORed into the data's first four bytes.
  __m512i a0 = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  __m512i a1 = _mm512_loadu_si512(p + 64);
  __m512i a2 = _mm512_loadu_si512(p + 128);
  __m512i a3 = _mm512_loadu_si512(p + 192);
  p += kFoldRound;
  n -= kFoldRound;
  const __m512i by_round = crc32c_fold_by<8 * kFoldRound>();
  for (; n >= kFoldRound; n -= kFoldRound, p += kFoldRound) {
    a0 = crc32c_fold(a0, by_round, _mm512_loadu_si512(p));
    a1 = crc32c_fold(a1, by_round, _mm512_loadu_si512(p + 64));
    a2 = crc32c_fold(a2, by_round, _mm512_loadu_si512(p + 128));
    a3 = crc32c_fold(a3, by_round, _mm512_loadu_si512(p + 192));
  }
  const __m512i by_block = crc32c_fold_by<512>();
  __m512i acc = crc32c_fold(a0, crc32c_fold_by<3 * 512>(), crc32c_fold(a1, crc32c_fold_by<2 * 512>(), a3));
  acc = crc32c_fold(a2, by_block, acc);
  for (; n >= 64; n -= 64, p += 64) acc = crc32c_fold(acc, by_block, _mm512_loadu_si512(p));
  alignas(64) uint8_t folded[64];
  _mm512_store_si512(folded, acc);
  return crc32c_sse42(crc32c_sse42(0, folded, sizeof(folded)), p, n);
}
#undef PDDCORE_FOLD512_TARGET
#endif

}  // namespace detail

inline bool crc32c_supported(Crc32cImpl impl) {
  switch (impl) {
    case Crc32cImpl::kTable:
      return true;
#ifdef PDDCORE_CRC32C_X86
    case Crc32cImpl::kSse42: {
      static const bool has = __builtin_cpu_supports("sse4.2");
      return has;
    }
    case Crc32cImpl::kFold512: {
      static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq") &&
                              __builtin_cpu_supports("sse4.2");
      return has;
    }
#endif
    default:
      return false;
  }
}

inline const char* crc32c_name(Crc32cImpl impl) {
  switch (impl) {
    case Crc32cImpl::kFold512:
      return "avx512-vpclmulqdq";
    case Crc32cImpl::kSse42:
      return "sse4.2";
    default:
      return "table";
  }
}

// By name ("table", "sse4.2", "avx512-vpclmulqdq"); the CPU must support it.
inline Crc32cImpl crc32c_impl_named(const std::string& name) {
  std::string known;
  for (Crc32cImpl impl : kCrc32cImpls) {
    if (name != crc32c_name(impl)) {
      known += (known.empty() ? "'" : ", '") + std::string(crc32c_name(impl)) + "'";
      continue;
    }
    if (!crc32c_supported(impl)) throw std::invalid_argument("this CPU cannot run the CRC32C implementation '" + name + "'");
    return impl;
  }
  throw std::invalid_argument("unknown CRC32C implementation '" + name + "' (known: " + known + ")");
}

// The fastest implementation this CPU supports.
inline Crc32cImpl crc32c_best() {
  static const Crc32cImpl best = crc32c_supported(Crc32cImpl::kFold512) ? Crc32cImpl::kFold512
                                 : crc32c_supported(Crc32cImpl::kSse42) ? Crc32cImpl::kSse42
                                                                        : Crc32cImpl::kTable;
  return best;
}

// CRC32C with a chosen implementation, which the CPU must support (crc32c_supported).
// Continues a CRC over more bytes: crc32c(b, crc32c(a)) == crc32c(a + b).
inline uint32_t crc32c_with(Crc32cImpl impl, const void* data, size_t n, uint32_t crc = 0) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  switch (impl) {
#ifdef PDDCORE_CRC32C_X86
    case Crc32cImpl::kFold512:
      return ~detail::crc32c_fold512(crc, p, n);
    case Crc32cImpl::kSse42:
      return ~detail::crc32c_sse42(crc, p, n);
#endif
    default:
      return ~detail::crc32c_software(crc, p, n);
  }
}

inline uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0) { return crc32c_with(crc32c_best(), data, n, crc); }

}  // namespace pddcore
