// The RC QP state machine of the verbs emulator.
#include "qp_state.h"

#include <cerrno>
#include <string>

namespace pddcore::rdma::emulator {
namespace {

// Required and allowed attribute masks of each RC transition (IB spec, "QP state transitions").
struct Transition {
  ibv_qp_state from, to;
  int required, allowed;
};
constexpr int kAlt = IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE;
constexpr Transition kTransitions[] = {
    {IBV_QPS_RESET, IBV_QPS_INIT, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0},
    {IBV_QPS_INIT, IBV_QPS_INIT, 0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS},
    {IBV_QPS_INIT, IBV_QPS_RTR,
     IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
         IBV_QP_MIN_RNR_TIMER,
     IBV_QP_ALT_PATH | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX},
    {IBV_QPS_RTR, IBV_QPS_RTS,
     IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
     IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | kAlt},
    {IBV_QPS_RTS, IBV_QPS_RTS, 0, IBV_QP_CUR_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | kAlt},
};

const Transition* find_transition(ibv_qp_state from, ibv_qp_state to) {
  for (const Transition& t : kTransitions)
    if (t.from == from && t.to == to) return &t;
  return nullptr;
}

bool attributes_valid(const ibv_qp_attr& a, int mask) {
  if ((mask & IBV_QP_PORT) && a.port_num != 1) return false;
  if ((mask & IBV_QP_PKEY_INDEX) && a.pkey_index != 0) return false;
  if ((mask & IBV_QP_ACCESS_FLAGS) && (a.qp_access_flags & ~kAccessKnown)) return false;
  if ((mask & IBV_QP_PATH_MTU) && (a.path_mtu < IBV_MTU_256 || a.path_mtu > IBV_MTU_4096)) return false;
  if ((mask & IBV_QP_AV) && (a.ah_attr.port_num != 1 || a.ah_attr.dlid == 0)) return false;
  if ((mask & IBV_QP_DEST_QPN) && a.dest_qp_num > kPsnMask) return false;
  if ((mask & IBV_QP_TIMEOUT) && a.timeout > 31) return false;
  if ((mask & IBV_QP_RETRY_CNT) && a.retry_cnt > 7) return false;
  if ((mask & IBV_QP_RNR_RETRY) && a.rnr_retry > 7) return false;
  if ((mask & IBV_QP_MIN_RNR_TIMER) && a.min_rnr_timer > 31) return false;
  if ((mask & IBV_QP_MAX_DEST_RD_ATOMIC) && a.max_dest_rd_atomic > 16) return false;
  if ((mask & IBV_QP_MAX_QP_RD_ATOMIC) && a.max_rd_atomic > 16) return false;
  return true;
}

}  // namespace

int check_transition_locked(const Qp& q, ibv_qp_state to, const ibv_qp_attr& a, int mask) {
  const ibv_qp_state from = q.state;
  if ((mask & IBV_QP_CUR_STATE) && a.cur_qp_state != from) return EINVAL;
  if (to == IBV_QPS_RESET || to == IBV_QPS_ERR) {
    if (mask & ~(IBV_QP_STATE | IBV_QP_CUR_STATE)) return EINVAL;
  } else {
    const Transition* t = find_transition(from, to);
    if (t == nullptr) return EINVAL;
    if ((mask & t->required) != t->required) return EINVAL;
    if (mask & ~(t->required | t->allowed | IBV_QP_STATE)) return EINVAL;
    if (!attributes_valid(a, mask)) return EINVAL;
  }
  return 0;
}

void apply_attributes_locked(Qp& q, const ibv_qp_attr& a, int mask) {
  if (mask & IBV_QP_ACCESS_FLAGS) q.access = a.qp_access_flags;
  if (mask & IBV_QP_AV) q.dest_lid = a.ah_attr.dlid;
  if (mask & IBV_QP_PATH_MTU) q.mtu_bytes = 128u << a.path_mtu;
  if (mask & IBV_QP_DEST_QPN) q.dest_qpn = a.dest_qp_num;
  if (mask & IBV_QP_RQ_PSN) q.expected_psn = a.rq_psn & kPsnMask;
  if (mask & IBV_QP_MIN_RNR_TIMER) q.min_rnr_timer = a.min_rnr_timer;
  if (mask & IBV_QP_SQ_PSN) q.next_psn = a.sq_psn & kPsnMask;
  if (mask & IBV_QP_TIMEOUT) q.timeout = a.timeout;
  if (mask & IBV_QP_RETRY_CNT) q.retry_cnt = a.retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) q.rnr_retry = a.rnr_retry;
}

void enter_error_locked(Qp& q, size_t failed, ibv_wc_status status) {
  q.state = IBV_QPS_ERR;
  for (size_t i = 0; i < q.send_queue.size(); ++i) {
    const SendWqe& w = q.send_queue[i];
    if (w.acked) continue;
    push_completion(q.send_cq, send_completion(q, w.wr_id, i == failed ? status : IBV_WC_WR_FLUSH_ERR));
  }
  q.send_queue.clear();
  for (uint64_t wr_id : q.receive_queue) {
    ibv_wc wc{};
    wc.wr_id = wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = q.handle.verbs.qp_num;
    push_completion(q.recv_cq, wc);
  }
  q.receive_queue.clear();
  q.receive_posted.notify_all();
}

size_t find_psn_locked(const Qp& q, uint32_t psn) {
  for (size_t i = 0; i < q.send_queue.size(); ++i)
    if (q.send_queue[i].sent && !q.send_queue[i].acked && q.send_queue[i].psn == psn) return i;
  return std::string::npos;
}

void handle_response_locked(Qp& q, Syndrome syndrome, uint32_t psn) {
  if (q.state != IBV_QPS_RTS) return;
  const size_t i = find_psn_locked(q, psn);
  if (i == std::string::npos) return;  // a duplicate response to a retransmission
  if (syndrome == Syndrome::kRemoteAccess) return enter_error_locked(q, i, IBV_WC_REM_ACCESS_ERR);
  if (syndrome == Syndrome::kReceiverNotReady) return enter_error_locked(q, i, IBV_WC_RNR_RETRY_EXC_ERR);
  SendWqe& w = q.send_queue[i];
  w.acked = true;
  if (!w.signaled) return;
  // A signaled completion retires it and every earlier (unsignaled) WR: their slots free up.
  push_completion(q.send_cq, send_completion(q, w.wr_id, IBV_WC_SUCCESS));
  q.send_queue.erase(q.send_queue.begin(), q.send_queue.begin() + static_cast<std::ptrdiff_t>(i) + 1);
}

}  // namespace pddcore::rdma::emulator
