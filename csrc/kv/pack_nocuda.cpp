// Built instead of pack_cuda.cu when no CUDA compiler was found.
#include <stdexcept>

#include "pack.h"

namespace pddcore::kv {
namespace {

[[noreturn]] void no_cuda() {
  throw std::runtime_error("pddcore was built without CUDA (no nvcc at build time); rebuild with nvcc on PATH");
}

}  // namespace

void check_cuda_layout(const KVLayoutDesc&, int) { no_cuda(); }
void upload_cuda(const CopyPlan&, void*, uint64_t, int, uintptr_t) { no_cuda(); }
void run_cuda(const CopyPlan&, const void*, uint64_t, uint8_t*, uint64_t, bool, Direction, int, uintptr_t) { no_cuda(); }
bool cuda_compiled() { return false; }
std::string cuda_unusable_reason() { return "pddcore was built without CUDA"; }
int cuda_device_count() { return 0; }

}  // namespace pddcore::kv
