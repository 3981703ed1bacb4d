// One kernel launch moves every (layer, plane, page) item of a pack or unpack.
// Blocks take items round-robin; threads copy 16 bytes at a time where both sides
// are 16-byte aligned, byte by byte otherwise (odd head slices).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "pack.h"
#include "copy_executor.h"

namespace pddcore::kv {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 65535;

__device__ inline void copy_row(uint8_t* dst, const uint8_t* src, uint64_t n) {
  const bool vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | n) & 15) == 0;
  if (vec) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (uint64_t i = threadIdx.x; i < n / 16; i += blockDim.x) d[i] = s[i];
  } else {
    for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
}

template <bool kPack>
__global__ void copy_items(const CopyItem* items, uint64_t num_items, uint8_t* packed) {
  for (uint64_t i = blockIdx.x; i < num_items; i += gridDim.x) {
    const CopyItem it = items[i];
    for (uint64_t r = 0; r < it.rows; ++r) {
      uint8_t* pool = reinterpret_cast<uint8_t*>(it.pool_addr + r * it.pool_stride);
      uint8_t* buf = packed + it.packed_offset + r * it.packed_stride;
      if (kPack)
        copy_row(buf, pool, it.row_bytes);
      else
        copy_row(pool, buf, it.row_bytes);
    }
  }
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err) + " (" +
                             std::to_string(static_cast<int>(err)) + ")");
}

// The kernel must be able to dereference the buffer: device memory, managed memory,
// or pinned host memory (mapped into the device's address space under UVA).
void check_device_accessible(const void* ptr, const char* name) {
  cudaPointerAttributes attr{};
  check(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
  if (attr.type == cudaMemoryTypeUnregistered)
    throw std::invalid_argument(std::string(name) + " is pageable host memory; use a CUDA tensor or pinned memory");
}

}  // namespace

void run_cuda(const PackRequest& req, Direction dir, uintptr_t stream_handle) {
  const std::string reason = cuda_unusable_reason();
  if (!reason.empty()) throw std::runtime_error("CUDA pack is not usable here: " + reason);
  std::vector<CopyItem> items = slice_items(plan_checked(req));
  if (items.empty()) return;
  check_device_accessible(req.buffer, "the packed buffer");
  for (const PlaneDesc& p : req.layout->planes()) check_device_accessible(reinterpret_cast<void*>(p.base), "a KV plane");

  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const size_t table_bytes = items.size() * sizeof(CopyItem);
  CopyItem* table = nullptr;
  check(cudaMallocAsync(reinterpret_cast<void**>(&table), table_bytes, stream), "cudaMallocAsync");
  check(cudaMemcpyAsync(table, items.data(), table_bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync");
  const int blocks = static_cast<int>(std::min<size_t>(items.size(), kMaxBlocks));
  if (dir == Direction::kPack)
    copy_items<true><<<blocks, kThreads, 0, stream>>>(table, items.size(), req.buffer);
  else
    copy_items<false><<<blocks, kThreads, 0, stream>>>(table, items.size(), req.buffer);
  check(cudaGetLastError(), "copy_items launch");
  check(cudaFreeAsync(table, stream), "cudaFreeAsync");
  // The host-side item vector is staged synchronously by cudaMemcpyAsync from
  // pageable memory, so it may go out of scope here.
}

bool cuda_compiled() { return true; }

std::string cuda_unusable_reason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky error so later calls report their own
    return std::string(cudaGetErrorString(err)) + " (error " + std::to_string(static_cast<int>(err)) + ")";
  }
  if (count == 0) return "no CUDA device";
  return "";
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

}  // namespace pddcore::kv
