#include "copy_executor.h"

#include <algorithm>
#include <cstring>

namespace pddcore::kv {
namespace {

constexpr uint64_t kSliceBytes = 1ull << 20;
// Below this many bytes a single thread is faster than waking the pool.
constexpr uint64_t kParallelThresholdBytes = 512ull << 10;

// Direction policies: which side of a CopyItem is the source.
struct PackDirection {
  static void copy(uint8_t* packed, uint8_t* pool, size_t n) { std::memcpy(packed, pool, n); }
};
struct UnpackDirection {
  static void copy(uint8_t* packed, uint8_t* pool, size_t n) { std::memcpy(pool, packed, n); }
};

template <typename Direction>
void run_item(const CopyItem& it, uint8_t* packed) {
  uint8_t* dst = packed + it.packed_offset;
  uint8_t* pool = reinterpret_cast<uint8_t*>(it.pool_addr);
  for (uint64_t r = 0; r < it.rows; ++r)
    Direction::copy(dst + r * it.packed_stride, pool + r * it.pool_stride, it.row_bytes);
}

template <typename Direction>
void execute(const std::vector<CopyItem>& items, uint8_t* packed, ThreadPool& pool) {
  uint64_t total = 0;
  for (const CopyItem& it : items) total += it.nbytes();
  if (total < kParallelThresholdBytes || pool.size() == 1) {
    for (const CopyItem& it : items) run_item<Direction>(it, packed);
    return;
  }
  const std::vector<CopyItem> slices = slice_items(items);
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
    for (size_t i = bounds[g]; i < bounds[g + 1]; ++i) run_item<Direction>(slices[i], packed);
  });
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
