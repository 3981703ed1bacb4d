// The verbs emulator's objects: the process-wide counters and completion queues.
#include "objects.h"

namespace pddcore::rdma::emulator {

GlobalCounters g_counters;

void push_completion(Cq* cq, const ibv_wc& wc) {
  std::lock_guard<std::mutex> lock(cq->mutex);
  if (cq->entries.size() >= cq->capacity) {
    cq->overrun = true;  // a CQ overrun loses completions; poll_cq reports it
    return;
  }
  cq->entries.push_back(wc);
}

ibv_wc send_completion(const Qp& q, uint64_t wr_id, ibv_wc_status status) {
  ibv_wc wc{};
  wc.wr_id = wr_id;
  wc.status = status;
  wc.opcode = IBV_WC_RDMA_WRITE;
  wc.qp_num = q.handle.verbs.qp_num;
  return wc;
}

}  // namespace pddcore::rdma::emulator
