#include <cuda_runtime.h>

#include "device_memory.h"

namespace pddcore::transfer {

bool is_device_memory(const void* ptr) {
  // Asked once: without a usable device every pointer is host memory, and each failed
  // CUDA call would only repeat the driver probe.
  static const bool have_device = [] {
    int count = 0;
    const bool ok = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
    cudaGetLastError();
    return ok;
  }();
  if (!have_device) return false;
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return attr.type == cudaMemoryTypeDevice;
}

}  // namespace pddcore::transfer
