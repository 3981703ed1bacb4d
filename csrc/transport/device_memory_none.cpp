#include "device_memory.h"

namespace pddcore::transfer {

bool is_device_memory(const void*) { return false; }  // built without CUDA: no device memory exists

}  // namespace pddcore::transfer
