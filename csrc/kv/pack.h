// Launchers for paged-KV pack/unpack: validate, plan, then copy on CPU threads or
// with one CUDA kernel. Every check happens before the first byte moves.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pddcore/kv_layout.h"

namespace pddcore::kv {

struct PageIds {
  const void* data;
  size_t count;
  bool is_int64;
};

struct PackRequest {
  const KVLayoutDesc* layout;
  PageIds page_ids;
  std::vector<int64_t> layers;  // empty: all layers
  HeadRange heads;              // {0, 0}: all heads
  uint8_t* buffer;
  uint64_t buffer_nbytes;
};

enum class Direction { kPack, kUnpack };

// Builds and checks the copy plan; throws std::invalid_argument on bad input.
std::vector<CopyItem> plan_checked(const PackRequest& req);

void run_cpu(const PackRequest& req, Direction dir);
void set_cpu_threads(size_t n);
size_t cpu_threads();

// CUDA path. `stream` is a cudaStream_t as an integer (0: the legacy default stream).
// The buffer may be device memory or pinned host memory.
void run_cuda(const PackRequest& req, Direction dir, uintptr_t stream);
bool cuda_compiled();
// Empty string when a CUDA device is usable, else the reason it is not.
std::string cuda_unusable_reason();
int cuda_device_count();

}  // namespace pddcore::kv
