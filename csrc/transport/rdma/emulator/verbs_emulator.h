// An in-process **verbs emulator**: a software model of one RDMA NIC port that fills the
// backend's VerbsTable on machines without RDMA hardware (and where soft-RoCE cannot be
// loaded). It is a test device, not a transport for production.
//
// It models the subset of ibverbs the RDMA backend uses, with the semantics of real RC
// hardware as far as an application can observe them:
//  - PD / MR with lkey and rkey. A write whose rkey is unknown, belongs to another PD, lacks
//    IBV_ACCESS_REMOTE_WRITE, or whose range leaves the MR completes at the requester with
//    IBV_WC_REM_ACCESS_ERR, and nothing is written; a bad lkey gives IBV_WC_LOC_PROT_ERR.
//  - CQs polled with poll_cq (no completion channels).
//  - RC QPs with the RESET -> INIT -> RTR -> RTS state machine, each transition checked for
//    its required and allowed attribute masks. post_send needs RTS, post_recv needs INIT or
//    later (EINVAL otherwise); a full queue gives ENOMEM.
//  - post_send of IBV_WR_RDMA_WRITE and IBV_WR_RDMA_WRITE_WITH_IMM; an immediate consumes a
//    posted receive at the responder (IBV_WC_RECV_RDMA_WITH_IMM). Selective signaling: an
//    unsignaled WR produces no completion on success and keeps its send-queue slot until a
//    later signaled WR completes; errors always complete.
//  - A failed WR moves the QP to the error state: every later WR, and every posted receive,
//    completes with IBV_WC_WR_FLUSH_ERR. The responder's QP also enters the error state on
//    a remote access error.
//  - Packet sequence numbers advance per path-MTU packet; packets out of sequence, for a
//    QP not ready to receive, or from a QP that is not the connected one are dropped, and
//    the requester ends with IBV_WC_RETRY_EXC_ERR once the local ACK timeout
//    (4.096 us * 2^timeout) has passed retry_cnt + 1 times. A peer that vanished is seen
//    the same way, as on a real fabric.
//
// The "wire" underneath: every opened device listens on a loopback TCP port, reported as
// the port's LID (GID 0 is ::ffff:127.0.0.1). A QP in RTS dials the LID given in its RTR
// address vector and sends its writes there; the responder validates and places the
// payload straight into the registered memory, then ACKs or NAKs. So two processes, each
// with an emulated device, exchange one-sided writes through real sockets.
//
// It is test support, so it ships as its own module (pddcore._verbs_emulator), not inside
// pddcore._C: the RDMA backend opens it with dlopen, as it opens libibverbs, when asked
// for device="emulator" (verbs_table.h, emulator_verbs).
#pragma once

#include <cstdint>

#include "../verbs_table.h"

namespace pddcore::rdma::emulator {

// The emulator's verbs. Its device list always holds one device, "verbs-emulator0".
const VerbsTable& verbs();

// Objects alive in this process (teardown tests check they return to zero) and traffic.
struct Counters {
  int64_t contexts = 0, pds = 0, mrs = 0, cqs = 0, qps = 0;
  int64_t wire_connections = 0;   // open requester and responder sockets
  uint64_t writes_placed = 0;     // RDMA writes placed into memory by responders
  uint64_t bytes_placed = 0;
  uint64_t writes_rejected = 0;   // NAKed with a remote access error
};
Counters counters();

}  // namespace pddcore::rdma::emulator

// The symbol the RDMA backend looks up after dlopen: the emulator's verbs().
extern "C" const pddcore::rdma::VerbsTable* pddcore_verbs_emulator_table();
