// One kernel launch moves every (layer, plane, page) item of a pack or unpack.
// Blocks take items round-robin; threads copy 16 bytes at a time where both sides
// are 16-byte aligned, byte by byte otherwise (odd head slices).
//
// The layout's planes are checked once when it is built (check_cuda_layout); a plan's
// items are uploaded once (upload_cuda); a run only launches, so it can be captured in
// a CUDA graph. Every entry point runs on the layout's device (DeviceGuard).
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "copy_executor.h"
#include "device_guard.h"
#include "pack.h"

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
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear a sticky error so later calls report their own
    throw std::runtime_error(std::string("CUDA error in ") + what + ": " + cudaGetErrorString(err) + " (" +
                             std::to_string(static_cast<int>(err)) + ")");
  }
}

struct CudaRuntime {
  static int current() {
    int device = 0;
    check(cudaGetDevice(&device), "cudaGetDevice");
    return device;
  }
  static void set(int device) { check(cudaSetDevice(device), "cudaSetDevice"); }
};
using Guard = DeviceGuard<CudaRuntime>;

void require_usable(int device) {
  const std::string reason = cuda_unusable_reason();
  if (!reason.empty()) throw std::runtime_error("CUDA pack is not usable here: " + reason);
  const int count = cuda_device_count();
  if (device < 0 || device >= count)
    throw std::invalid_argument("CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(count) +
                                " devices)");
}

// The kernel on `device` must be able to dereference `ptr`: memory of that device, or
// pinned host / managed memory (mapped into every device's address space under UVA).
void check_reachable(const void* ptr, int device, const std::string& name) {
  cudaPointerAttributes attr{};
  check(cudaPointerGetAttributes(&attr, ptr), "cudaPointerGetAttributes");
  if (attr.type == cudaMemoryTypeUnregistered)
    throw std::invalid_argument(name + " is pageable host memory; use a CUDA tensor or pinned memory");
  if (attr.type == cudaMemoryTypeDevice && attr.device != device)
    throw std::invalid_argument(name + " is memory of CUDA device " + std::to_string(attr.device) +
                                ", but the layout is on device " + std::to_string(device));
}

void check_table(const CopyPlan& plan, uint64_t table_nbytes) {
  if (table_nbytes != plan.device_table_nbytes())
    throw std::invalid_argument("the plan's device table holds " + std::to_string(table_nbytes) + " bytes, expected " +
                                std::to_string(plan.device_table_nbytes()));
}

}  // namespace

void check_cuda_layout(const KVLayoutDesc& layout, int device) {
  require_usable(device);
  Guard guard(device);
  const auto& planes = layout.planes();
  for (size_t i = 0; i < planes.size(); ++i)
    if (planes[i].num_pages > 0)
      check_reachable(reinterpret_cast<const void*>(planes[i].base), device, "KV plane " + std::to_string(i));
}

void upload_cuda(const CopyPlan& plan, void* table, uint64_t table_nbytes, int device, uintptr_t stream_handle) {
  check_table(plan, table_nbytes);
  if (table_nbytes == 0) return;
  Guard guard(device);
  // From pageable memory the copy is staged before it returns, so the plan's host items
  // may change or go afterwards.
  check(cudaMemcpyAsync(table, plan.device_items().data(), table_nbytes, cudaMemcpyHostToDevice,
                        reinterpret_cast<cudaStream_t>(stream_handle)),
        "cudaMemcpyAsync");
}

void run_cuda(const CopyPlan& plan, const void* table, uint64_t table_nbytes, uint8_t* buffer, uint64_t buffer_nbytes,
              bool buffer_on_host, Direction dir, int device, uintptr_t stream_handle) {
  check_table(plan, table_nbytes);
  plan.check_buffer(buffer_nbytes);
  const uint64_t num_items = plan.device_items().size();
  if (num_items == 0) return;
  Guard guard(device);
  if (buffer_on_host) check_reachable(buffer, device, "the packed buffer");
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const CopyItem* items = static_cast<const CopyItem*>(table);
  const int blocks = static_cast<int>(std::min<uint64_t>(num_items, kMaxBlocks));
  if (dir == Direction::kPack)
    copy_items<true><<<blocks, kThreads, 0, stream>>>(items, num_items, buffer);
  else
    copy_items<false><<<blocks, kThreads, 0, stream>>>(items, num_items, buffer);
  check(cudaGetLastError(), "copy_items launch");
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
