// Executes a KV copy plan (pddcore/kv_layout.h's CopyItems) on the CPU. The plan's items
// are cut into slices of about 1 MiB so that threads share the bytes evenly, whatever the
// page size.
#pragma once

#include <cstdint>
#include <vector>

#include "pack.h"
#include "pddcore/kv_layout.h"
#include "thread_pool.h"

namespace pddcore::kv {

// The plan with every item longer than a slice cut into slices (the CUDA kernel's blocks
// take slices too).
std::vector<CopyItem> slice_items(const std::vector<CopyItem>& items);

// Copies pool -> packed (kPack) or packed -> pool (kUnpack) for every item, across `pool`.
void execute_cpu(const std::vector<CopyItem>& items, uint8_t* packed, Direction dir, ThreadPool& pool);

}  // namespace pddcore::kv
