// Plans of pack/unpack and their CPU launcher: copies across a thread pool.
#include <algorithm>
#include <thread>

#include "copy_executor.h"
#include "pack.h"
#include "thread_pool.h"

namespace pddcore::kv {

static ThreadPool& pool() {
  static ThreadPool p(std::max(1u, std::thread::hardware_concurrency()));
  return p;
}

template <typename Id>
static std::vector<CopyItem> plan_of(const KVLayoutDesc& layout, const Id* ids, size_t n,
                                     const std::vector<int64_t>& layers, HeadRange heads, bool pool_order) {
  if (!pool_order) return layout.plan(ids, n, layers, heads);
  if (heads.begin != 0 || heads.end != 0) throw std::invalid_argument("pool order copies whole pages: no head slice");
  return layout.plan_pool_order(ids, n, layers);
}

CopyPlan::CopyPlan(const KVLayoutDesc& layout, PageIds ids, const std::vector<int64_t>& layers, HeadRange heads,
                   bool for_cuda, bool pool_order)
    : items_(ids.is_int64
                 ? plan_of(layout, static_cast<const int64_t*>(ids.data), ids.count, layers, heads, pool_order)
                 : plan_of(layout, static_cast<const int32_t*>(ids.data), ids.count, layers, heads, pool_order)),
      // Pool-order spans are tiled by the pages' cells: the same bytes as canonical order.
      nbytes_(layout.packed_nbytes(ids.count, layers, heads)) {
  if (for_cuda) device_items_ = slice_items(items_);
}

void CopyPlan::check_buffer(uint64_t buffer_nbytes) const {
  if (buffer_nbytes < nbytes_)
    throw std::invalid_argument("buffer too small: " + std::to_string(buffer_nbytes) + " bytes, need " +
                                std::to_string(nbytes_));
}

void run_cpu(const CopyPlan& plan, uint8_t* buffer, uint64_t buffer_nbytes, Direction dir) {
  plan.check_buffer(buffer_nbytes);
  execute_cpu(plan.items(), buffer, dir, pool());
}

void set_cpu_threads(size_t n) {
  if (n == 0) throw std::invalid_argument("thread count must be >= 1");
  pool().resize(n);
}

size_t cpu_threads() { return pool().size(); }

}  // namespace pddcore::kv
