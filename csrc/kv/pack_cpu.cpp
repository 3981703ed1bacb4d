// Launcher of the CPU pack/unpack: checks the plan, then copies across a thread pool.
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

std::vector<CopyItem> plan_checked(const PackRequest& req) {
  const PageIds& ids = req.page_ids;
  std::vector<CopyItem> items =
      ids.is_int64 ? req.layout->plan(static_cast<const int64_t*>(ids.data), ids.count, req.layers, req.heads)
                   : req.layout->plan(static_cast<const int32_t*>(ids.data), ids.count, req.layers, req.heads);
  const uint64_t need = req.layout->packed_nbytes(ids.count, req.layers, req.heads);
  if (req.buffer_nbytes < need)
    throw std::invalid_argument("buffer too small: " + std::to_string(req.buffer_nbytes) + " bytes, need " +
                                std::to_string(need));
  return items;
}

void run_cpu(const PackRequest& req, Direction dir) {
  execute_cpu(plan_checked(req), req.buffer, dir, pool());
}

void set_cpu_threads(size_t n) {
  if (n == 0) throw std::invalid_argument("thread count must be >= 1");
  pool().resize(n);
}

size_t cpu_threads() { return pool().size(); }

}  // namespace pddcore::kv
