// Built instead of pack_cuda.cu when no CUDA compiler was found.
#include <stdexcept>

#include "pack.h"

namespace pddcore::kv {

void run_cuda(const PackRequest&, Direction, uintptr_t) {
  throw std::runtime_error("pddcore was built without CUDA (no nvcc at build time); rebuild with nvcc on PATH");
}
bool cuda_compiled() { return false; }
std::string cuda_unusable_reason() { return "pddcore was built without CUDA"; }
int cuda_device_count() { return 0; }

}  // namespace pddcore::kv
