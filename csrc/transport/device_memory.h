// Whether an address is GPU memory the CPU cannot touch. The tcp path reads and writes
// registered memory with the CPU (recv, CRC32C), so such memory must never reach it.
#pragma once

namespace pddcore::transfer {

// True for CUDA device memory; false for host memory (pageable or pinned), managed
// memory, and everything when no CUDA device is usable or CUDA is not compiled in.
bool is_device_memory(const void* ptr);

}  // namespace pddcore::transfer
