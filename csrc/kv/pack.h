// Launchers for paged-KV pack/unpack, split as plan and run: a CopyPlan reads the page
// ids on the host and checks them once per batch; running it copies on CPU threads or
// launches one CUDA kernel, with no host work but the launch. Every check happens before
// the first byte moves.
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

enum class Direction { kPack, kUnpack };

// The checked copy plan of one selection of a layout's pages. The items hold the
// layout's addresses, so the layout's memory must outlive the plan.
class CopyPlan {
 public:
  // Throws std::invalid_argument on a bad page id, layer or head range. `for_cuda` also
  // prepares the items the CUDA kernel takes (each cut into slices). `pool_order`: the
  // pages' spans as they lie in the pool (KVLayoutDesc::plan_pool_order), all heads.
  CopyPlan(const KVLayoutDesc& layout, PageIds ids, const std::vector<int64_t>& layers, HeadRange heads,
           bool for_cuda, bool pool_order = false);

  // Bytes the selection packs to.
  uint64_t nbytes() const { return nbytes_; }
  const std::vector<CopyItem>& items() const { return items_; }
  const std::vector<CopyItem>& device_items() const { return device_items_; }
  uint64_t device_table_nbytes() const { return device_items_.size() * sizeof(CopyItem); }
  // Throws std::invalid_argument when `buffer_nbytes` cannot hold the packed bytes.
  void check_buffer(uint64_t buffer_nbytes) const;

 private:
  std::vector<CopyItem> items_;
  std::vector<CopyItem> device_items_;
  uint64_t nbytes_ = 0;
};

void run_cpu(const CopyPlan& plan, uint8_t* buffer, uint64_t buffer_nbytes, Direction dir);
void set_cpu_threads(size_t n);
size_t cpu_threads();

// CUDA path. `device` is the CUDA device that owns the layout: every entry point makes it
// current for its duration (and restores the caller's), so `stream` - a cudaStream_t as
// an integer, 0 for the legacy default stream - is that device's stream.

// Checks, once when a layout is built, that `device` exists and every plane lives on it
// (device memory of that device, or memory mapped into it: pinned host or managed).
void check_cuda_layout(const KVLayoutDesc& layout, int device);
// Copies the plan's device items into `table` (device memory on `device`, exactly
// plan.device_table_nbytes() bytes), ordered on `stream`.
void upload_cuda(const CopyPlan& plan, void* table, uint64_t table_nbytes, int device, uintptr_t stream);
// Launches the copy of an uploaded plan on `stream`. `buffer` is device memory on
// `device` or, when `buffer_on_host`, pinned host memory.
void run_cuda(const CopyPlan& plan, const void* table, uint64_t table_nbytes, uint8_t* buffer, uint64_t buffer_nbytes,
              bool buffer_on_host, Direction dir, int device, uintptr_t stream);
bool cuda_compiled();
// Empty string when a CUDA device is usable, else the reason it is not.
std::string cuda_unusable_reason();
int cuda_device_count();

}  // namespace pddcore::kv
