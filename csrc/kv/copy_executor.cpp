#include "copy_executor.h"

#include <algorithm>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace pddcore::kv {
namespace {

constexpr uint64_t kSliceBytes = 1ull << 20;
// Pool bytes one CPU piece of rows with gaps between them spans (see cut_gapped_rows).
constexpr uint64_t kGappedSliceSpan = 8ull << 10;
// Below this many bytes a single thread is faster than waking the pool.
constexpr uint64_t kParallelThresholdBytes = 512ull << 10;
// From this many bytes on, the destination will not stay in cache anyway: stores bypass it
// (non-temporal), so the CPU does not first read every destination line it overwrites,
// which costs a third of the memory traffic of a copy.
constexpr uint64_t kStreamThresholdBytes = 8ull << 20;
// Rows up to this long are copied inline (a memcpy call per 256-byte cell costs about as
// much as moving it).
constexpr uint64_t kInlineRowBytes = 1024;

// Copies n bytes; kStream: with non-temporal stores (x86), after aligning the destination.
template <bool kStream>
inline void copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t n) {
#if defined(__SSE2__)
  if (kStream) {
    const uint64_t head = std::min<uint64_t>(n, (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15);
    if (head) {
      std::memcpy(dst, src, head);
      dst += head, src += head, n -= head;
    }
  }
  const auto store = [](uint8_t* d, __m128i v) {
    if (kStream)
      _mm_stream_si128(reinterpret_cast<__m128i*>(d), v);
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d), v);
  };
  uint64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    store(dst + i, a), store(dst + i + 16, b), store(dst + i + 32, c), store(dst + i + 48, d);
  }
  for (; i + 16 <= n; i += 16) store(dst + i, _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  if (i < n) std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

template <bool kStream>
inline void copy_row(uint8_t* dst, const uint8_t* src, uint64_t n) {
  if (kStream || n <= kInlineRowBytes)
    copy_bytes<kStream>(dst, src, n);
  else
    std::memcpy(dst, src, n);
}

// Direction policies: which side of a CopyItem is the source.
struct PackDirection {
  template <bool kStream>
  static void copy(uint8_t* packed, uint8_t* pool, uint64_t n) { copy_row<kStream>(packed, pool, n); }
};
struct UnpackDirection {
  template <bool kStream>
  static void copy(uint8_t* packed, uint8_t* pool, uint64_t n) { copy_row<kStream>(pool, packed, n); }
};

template <typename Direction, bool kStream>
void run_item(const CopyItem& it, uint8_t* packed) {
  uint8_t* dst = packed + it.packed_offset;
  uint8_t* pool = reinterpret_cast<uint8_t*>(it.pool_addr);
  for (uint64_t r = 0; r < it.rows; ++r)
    Direction::template copy<kStream>(dst + r * it.packed_stride, pool + r * it.pool_stride, it.row_bytes);
}

template <typename Direction, bool kStream>
void run_items(const CopyItem* begin, const CopyItem* end, uint8_t* packed) {
  for (const CopyItem* it = begin; it != end; ++it) run_item<Direction, kStream>(*it, packed);
#if defined(__SSE2__)
  if (kStream) _mm_sfence();  // non-temporal stores are weakly ordered: finish them before reporting done
#endif
}

// Items whose rows have gaps between them (vLLM's K and V halves of one row) cut into
// pieces spanning at most kGappedSliceSpan pool bytes, so that sorted by address the K and
// V pieces of the same rows run back to back while those rows are still in cache.
std::vector<CopyItem> cut_gapped_rows(const std::vector<CopyItem>& items) {
  std::vector<CopyItem> out;
  out.reserve(items.size());
  for (const CopyItem& it : items) {
    if (it.rows <= 1 || it.pool_stride <= it.row_bytes || it.rows * it.pool_stride <= kGappedSliceSpan) {
      out.push_back(it);
      continue;
    }
    const uint64_t rows_per_piece = std::max<uint64_t>(1, kGappedSliceSpan / it.pool_stride);
    for (uint64_t r = 0; r < it.rows; r += rows_per_piece)
      out.push_back({it.pool_addr + r * it.pool_stride, it.packed_offset + r * it.packed_stride,
                     std::min(rows_per_piece, it.rows - r), it.row_bytes, it.pool_stride, it.packed_stride});
  }
  return out;
}

template <typename Direction, bool kStream>
void execute(const std::vector<CopyItem>& items, uint64_t total, uint8_t* packed, ThreadPool& pool) {
  if (total < kParallelThresholdBytes) {
    run_items<Direction, kStream>(items.data(), items.data() + items.size(), packed);
    return;
  }
  std::vector<CopyItem> slices = cut_gapped_rows(slice_items(items));
  // In pool address order: a layer's K and V halves of the same rows (vLLM) are then read
  // one right after the other, and the pool front to back whatever the page ids' order.
  std::stable_sort(slices.begin(), slices.end(),
                   [](const CopyItem& a, const CopyItem& b) { return a.pool_addr < b.pool_addr; });
  if (pool.size() == 1) {
    run_items<Direction, kStream>(slices.data(), slices.data() + slices.size(), packed);
    return;
  }
  // Contiguous groups of slices with roughly equal bytes, a few per thread so a slow
  // thread does not hold up the rest.
  const size_t groups = std::min(slices.size(), pool.size() * 4);
  const uint64_t target = (total + groups - 1) / groups;
  std::vector<size_t> bounds{0};
  uint64_t acc = 0;
  for (size_t i = 0; i < slices.size(); ++i) {
    acc += slices[i].nbytes();
    if (acc >= target && i + 1 < slices.size()) {
      bounds.push_back(i + 1);
      acc = 0;
    }
  }
  bounds.push_back(slices.size());
  pool.run(bounds.size() - 1, [&](size_t g) {
    run_items<Direction, kStream>(slices.data() + bounds[g], slices.data() + bounds[g + 1], packed);
  });
}

template <typename Direction>
void execute(const std::vector<CopyItem>& items, uint8_t* packed, ThreadPool& pool) {
  uint64_t total = 0;
  for (const CopyItem& it : items) total += it.nbytes();
  if (total >= kStreamThresholdBytes)
    execute<Direction, true>(items, total, packed, pool);
  else
    execute<Direction, false>(items, total, packed, pool);
}

}  // namespace

std::vector<CopyItem> slice_items(const std::vector<CopyItem>& items) {
  std::vector<CopyItem> out;
  out.reserve(items.size());
  for (const CopyItem& it : items) {
    if (it.nbytes() <= kSliceBytes) {
      out.push_back(it);
    } else if (it.rows == 1) {
      for (uint64_t done = 0; done < it.row_bytes; done += kSliceBytes) {
        const uint64_t n = std::min(kSliceBytes, it.row_bytes - done);
        out.push_back({it.pool_addr + done, it.packed_offset + done, 1, n, 0, 0});
      }
    } else {
      const uint64_t rows_per_slice = std::max<uint64_t>(1, kSliceBytes / it.row_bytes);
      for (uint64_t r = 0; r < it.rows; r += rows_per_slice) {
        const uint64_t n = std::min(rows_per_slice, it.rows - r);
        out.push_back({it.pool_addr + r * it.pool_stride, it.packed_offset + r * it.packed_stride, n, it.row_bytes,
                       it.pool_stride, it.packed_stride});
      }
    }
  }
  return out;
}

void execute_cpu(const std::vector<CopyItem>& items, uint8_t* packed, Direction dir, ThreadPool& pool) {
  if (dir == Direction::kPack)
    execute<PackDirection>(items, packed, pool);
  else
    execute<UnpackDirection>(items, packed, pool);
}

}  // namespace pddcore::kv
