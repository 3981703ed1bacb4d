// The RC QP state machine of the verbs emulator: which modify_qp calls are legal (the IB
// spec's required and allowed attribute masks per transition), the attributes they set,
// the error state, and how the requester retires send WRs as responses arrive. Every
// function with the suffix _locked runs under Qp::mutex.
#pragma once

#include <cstddef>
#include <cstdint>

#include "objects.h"

namespace pddcore::rdma::emulator {

// What a responder answers a write with.
enum class Syndrome : uint8_t { kAck = 0, kRemoteAccess = 1, kReceiverNotReady = 2 };

// 0 when modify_qp(attr, mask) may move `q` from its current state to `to`, else EINVAL.
int check_transition_locked(const Qp& q, ibv_qp_state to, const ibv_qp_attr& a, int mask);

// Stores the attributes named in `mask` (a transition check_transition_locked accepted).
void apply_attributes_locked(Qp& q, const ibv_qp_attr& a, int mask);

// Moves the QP to the error state. The WR at `failed` (an index into the send queue, or
// npos for none) completes with `status`; every later send WR and every posted receive
// completes with IBV_WC_WR_FLUSH_ERR. WRs before it already succeeded.
void enter_error_locked(Qp& q, size_t failed, ibv_wc_status status);

// The index in the send queue of the sent, unacknowledged WR starting at `psn`, or npos.
size_t find_psn_locked(const Qp& q, uint32_t psn);

// The responder's answer to the WR at `psn`: an ACK completes it (if signaled, retiring
// every earlier WR too), a NAK fails it and moves the QP to the error state.
void handle_response_locked(Qp& q, Syndrome syndrome, uint32_t psn);

}  // namespace pddcore::rdma::emulator
