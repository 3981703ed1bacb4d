// Unit tests of the verbs emulator's semantics, written against the verbs table exactly as
// the RDMA backend uses it. Built and run by tests/test_transfer_rdma.py; one case per
// invocation: `verbs_emulator_test <case>`, exit status 0 on success.
#include <infiniband/verbs.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "transport/rdma/emulator/verbs_emulator.h"

using pddcore::rdma::VerbsTable;
namespace emu = pddcore::rdma::emulator;

namespace {

const VerbsTable& V = emu::verbs();

struct Node {
  ibv_context* ctx = nullptr;
  ibv_pd* pd = nullptr;
  ibv_cq* cq = nullptr;
  ibv_qp* qp = nullptr;
  uint16_t lid = 0;

  explicit Node(uint32_t max_send_wr = 64) {
    int n = 0;
    ibv_device** list = V.get_device_list(&n);
    CHECK(list != nullptr && n == 1);
    ctx = V.open_device(list[0]);
    V.free_device_list(list);
    CHECK(ctx != nullptr);
    ibv_port_attr port{};
    CHECK(V.query_port(ctx, 1, &port) == 0);
    CHECK(port.state == IBV_PORT_ACTIVE);
    lid = port.lid;
    pd = V.alloc_pd(ctx);
    cq = V.create_cq(ctx, 256, nullptr, nullptr, 0);
    ibv_qp_init_attr init{};
    init.send_cq = init.recv_cq = cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = max_send_wr;
    init.cap.max_recv_wr = 64;
    init.cap.max_send_sge = init.cap.max_recv_sge = 1;
    qp = V.create_qp(pd, &init);
    CHECK(qp != nullptr);
  }
  ~Node() {
    if (qp) CHECK(V.destroy_qp(qp) == 0);
    CHECK(V.destroy_cq(cq) == 0);
    CHECK(V.dealloc_pd(pd) == 0);
    CHECK(V.close_device(ctx) == 0);
  }
};

int to_init(ibv_qp* qp, int access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_INIT;
  a.port_num = 1;
  a.qp_access_flags = access;
  return V.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

int to_rtr(ibv_qp* qp, uint16_t dlid, uint32_t dest_qpn, uint32_t rq_psn) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_1024;
  a.dest_qp_num = dest_qpn;
  a.rq_psn = rq_psn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.dlid = dlid;
  a.ah_attr.port_num = 1;
  return V.modify_qp(qp, &a,
                     IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                         IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

int to_rts(ibv_qp* qp, uint32_t sq_psn, uint8_t timeout = 14) {
  ibv_qp_attr a{};
  a.qp_state = IBV_QPS_RTS;
  a.sq_psn = sq_psn;
  a.timeout = timeout;
  a.retry_cnt = 2;
  a.rnr_retry = 1;
  a.max_rd_atomic = 1;
  return V.modify_qp(qp, &a,
                     IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                         IBV_QP_MAX_QP_RD_ATOMIC);
}

// Connects a (requester) to b (responder); psn_skew desynchronizes the sequence numbers.
void connect(Node& a, Node& b, uint8_t timeout = 14, uint32_t psn_skew = 0) {
  CHECK(to_init(a.qp) == 0);
  CHECK(to_init(b.qp) == 0);
  CHECK(to_rtr(b.qp, a.lid, a.qp->qp_num, 100) == 0);
  CHECK(to_rtr(a.qp, b.lid, b.qp->qp_num, 500) == 0);
  CHECK(to_rts(a.qp, 100 + psn_skew, timeout) == 0);
  CHECK(to_rts(b.qp, 500, timeout) == 0);
}

ibv_send_wr write_wr(ibv_sge* sge, uint64_t raddr, uint32_t rkey, bool imm, bool signaled, uint64_t wr_id) {
  ibv_send_wr wr{};
  wr.wr_id = wr_id;
  wr.sg_list = sge;
  wr.num_sge = 1;
  wr.opcode = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
  wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
  wr.imm_data = 0x01020304;
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  return wr;
}

int post_recv(ibv_qp* qp, uint64_t wr_id) {
  ibv_recv_wr wr{}, *bad = nullptr;
  wr.wr_id = wr_id;
  return V.post_recv(qp, &wr, &bad);
}

// Polls until n completions arrived (or 10 s passed, then fails).
std::vector<ibv_wc> poll_n(ibv_cq* cq, size_t n) {
  std::vector<ibv_wc> out;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (out.size() < n) {
    ibv_wc wc[16];
    const int got = V.poll_cq(cq, 16, wc);
    CHECK(got >= 0);
    out.insert(out.end(), wc, wc + got);
    if (got == 0) {
      CHECK(std::chrono::steady_clock::now() < until);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  return out;
}

void expect_no_more(ibv_cq* cq) {
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ibv_wc wc;
  CHECK(V.poll_cq(cq, 1, &wc) == 0);
}

// ---------------------------------------------------------------- cases

void state_machine() {
  Node a;
  ibv_send_wr* bad = nullptr;
  std::vector<uint8_t> buf(64);
  ibv_mr* mr = V.reg_mr(a.pd, buf.data(), buf.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_sge sge{reinterpret_cast<uint64_t>(buf.data()), 64, mr->lkey};
  ibv_send_wr wr = write_wr(&sge, 0, 0, false, true, 1);
  CHECK(V.post_send(a.qp, &wr, &bad) == EINVAL && bad == &wr);  // RESET
  CHECK(post_recv(a.qp, 1) == EINVAL);                            // RESET refuses receives
  CHECK(to_rtr(a.qp, 1, 1, 0) == EINVAL);                         // RESET -> RTR skips INIT
  CHECK(to_rts(a.qp, 0) == EINVAL);
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_INIT;
  attr.port_num = 1;
  CHECK(V.modify_qp(a.qp, &attr, IBV_QP_STATE | IBV_QP_PORT) == EINVAL);  // required masks missing
  CHECK(V.modify_qp(a.qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS |
                                     IBV_QP_SQ_PSN) == EINVAL);  // a mask RESET->INIT does not allow
  attr.port_num = 2;
  CHECK(V.modify_qp(a.qp, &attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == EINVAL);
  CHECK(to_init(a.qp) == 0 && a.qp->state == IBV_QPS_INIT);
  CHECK(post_recv(a.qp, 1) == 0);  // INIT accepts receives
  CHECK(V.post_send(a.qp, &wr, &bad) == EINVAL);
  CHECK(to_rts(a.qp, 0) == EINVAL);  // INIT -> RTS skips RTR
  ibv_qp_attr rtr{};
  rtr.qp_state = IBV_QPS_RTR;
  rtr.path_mtu = IBV_MTU_1024;
  rtr.ah_attr.dlid = 1;
  rtr.ah_attr.port_num = 1;
  CHECK(V.modify_qp(a.qp, &rtr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU) == EINVAL);  // no DEST_QPN etc.
  CHECK(to_rtr(a.qp, a.lid, a.qp->qp_num, 0) == 0);
  CHECK(V.post_send(a.qp, &wr, &bad) == EINVAL);  // RTR cannot send
  CHECK(to_rts(a.qp, 0) == 0 && a.qp->state == IBV_QPS_RTS);
  CHECK(to_init(a.qp) == EINVAL);  // RTS -> INIT is not a transition
  // To ERR: the posted receive is flushed; posting afterwards completes flushed too.
  attr = ibv_qp_attr{};
  attr.qp_state = IBV_QPS_ERR;
  CHECK(V.modify_qp(a.qp, &attr, IBV_QP_STATE) == 0);
  auto wcs = poll_n(a.cq, 1);
  CHECK(wcs[0].status == IBV_WC_WR_FLUSH_ERR && wcs[0].opcode == IBV_WC_RECV && wcs[0].wr_id == 1);
  CHECK(V.post_send(a.qp, &wr, &bad) == 0);
  wcs = poll_n(a.cq, 1);
  CHECK(wcs[0].status == IBV_WC_WR_FLUSH_ERR && wcs[0].wr_id == 1);
  // ERR -> RESET -> INIT works again.
  attr.qp_state = IBV_QPS_RESET;
  CHECK(V.modify_qp(a.qp, &attr, IBV_QP_STATE) == 0);
  CHECK(to_init(a.qp) == 0);
  CHECK(V.dereg_mr(mr) == 0);
}

void write_chain() {
  Node a, b;
  connect(a, b);
  std::vector<uint8_t> src(10000), dst(12000, 0);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  ibv_mr* smr = V.reg_mr(a.pd, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = V.reg_mr(b.pd, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  CHECK(post_recv(b.qp, 77) == 0);
  // Three pieces, unsignaled but the last, which carries the immediate.
  const uint32_t pieces[3][2] = {{0, 3000}, {3000, 4500}, {7500, 2500}};
  ibv_sge sge[3];
  ibv_send_wr wr[3];
  for (int i = 0; i < 3; ++i) {
    sge[i] = {reinterpret_cast<uint64_t>(src.data()) + pieces[i][0], pieces[i][1], smr->lkey};
    wr[i] = write_wr(&sge[i], reinterpret_cast<uint64_t>(dst.data()) + 1000 + pieces[i][0], dmr->rkey, i == 2, i == 2,
                     10 + i);
    if (i > 0) wr[i - 1].next = &wr[i];
  }
  ibv_send_wr* bad = nullptr;
  CHECK(V.post_send(a.qp, wr, &bad) == 0);
  auto send = poll_n(a.cq, 1);
  CHECK(send[0].status == IBV_WC_SUCCESS && send[0].wr_id == 12 && send[0].opcode == IBV_WC_RDMA_WRITE);
  auto recv = poll_n(b.cq, 1);
  CHECK(recv[0].status == IBV_WC_SUCCESS && recv[0].opcode == IBV_WC_RECV_RDMA_WITH_IMM);
  CHECK(recv[0].wr_id == 77 && recv[0].imm_data == 0x01020304 && (recv[0].wc_flags & IBV_WC_WITH_IMM));
  CHECK(recv[0].byte_len == 2500 && recv[0].src_qp == a.qp->qp_num);
  CHECK(std::memcmp(dst.data() + 1000, src.data(), src.size()) == 0);
  for (int i = 0; i < 1000; ++i) CHECK(dst[i] == 0 && dst[11000 + i] == 0);
  expect_no_more(a.cq);  // unsignaled writes completed silently
  CHECK(V.dereg_mr(smr) == 0 && V.dereg_mr(dmr) == 0);
}

// A remote-side fault: `mode` picks which check the write fails.
void remote_access_error(const std::string& mode) {
  Node a, b;
  connect(a, b);
  std::vector<uint8_t> src(4096, 0xAB), dst(4096, 0);
  ibv_mr* smr = V.reg_mr(a.pd, src.data(), src.size(), IBV_ACCESS_LOCAL_WRITE);
  const int dst_access = mode == "no_remote_write" ? IBV_ACCESS_LOCAL_WRITE
                                                   : IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  ibv_mr* dmr = V.reg_mr(b.pd, dst.data(), dst.size(), dst_access);
  CHECK(post_recv(b.qp, 5) == 0);
  uint64_t raddr = reinterpret_cast<uint64_t>(dst.data());
  uint32_t rkey = dmr->rkey;
  uint32_t len = 4096;
  if (mode == "bad_rkey") rkey ^= 0x5A5A00;
  if (mode == "out_of_range") raddr += 1;  // one byte past the end
  if (mode == "before_start") raddr -= 8;
  ibv_sge s1{reinterpret_cast<uint64_t>(src.data()), len, smr->lkey};
  ibv_sge s2{reinterpret_cast<uint64_t>(src.data()), 16, smr->lkey};
  ibv_send_wr w1 = write_wr(&s1, raddr, rkey, false, false, 1);  // unsignaled: its error completes anyway
  ibv_send_wr w2 = write_wr(&s2, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, true, true, 2);
  w1.next = &w2;
  ibv_send_wr* bad = nullptr;
  CHECK(V.post_send(a.qp, &w1, &bad) == 0);
  auto wcs = poll_n(a.cq, 2);
  CHECK(wcs[0].wr_id == 1 && wcs[0].status == IBV_WC_REM_ACCESS_ERR);
  CHECK(wcs[1].wr_id == 2 && wcs[1].status == IBV_WC_WR_FLUSH_ERR);
  CHECK(std::string(V.wc_status_str(wcs[0].status)) == "remote access error");
  // The responder's QP entered the error state: its receive is flushed, nothing was written.
  auto rwc = poll_n(b.cq, 1);
  CHECK(rwc[0].wr_id == 5 && rwc[0].status == IBV_WC_WR_FLUSH_ERR);
  for (uint8_t v : dst) CHECK(v == 0);
  CHECK(V.post_send(a.qp, &w2, &bad) == 0);  // accepted, then flushed
  CHECK(poll_n(a.cq, 1)[0].status == IBV_WC_WR_FLUSH_ERR);
  CHECK(emu::counters().writes_rejected >= 1);
  CHECK(V.dereg_mr(smr) == 0 && V.dereg_mr(dmr) == 0);
}

void bad_lkey() {
  Node a, b;
  connect(a, b);
  std::vector<uint8_t> src(256), dst(256);
  ibv_mr* smr = V.reg_mr(a.pd, src.data(), 128, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = V.reg_mr(b.pd, dst.data(), dst.size(), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ibv_sge s{reinterpret_cast<uint64_t>(src.data()), 256, smr->lkey};  // longer than the MR
  ibv_send_wr w = write_wr(&s, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, false, true, 9);
  ibv_send_wr* bad = nullptr;
  CHECK(V.post_send(a.qp, &w, &bad) == 0);
  auto wcs = poll_n(a.cq, 1);
  CHECK(wcs[0].wr_id == 9 && wcs[0].status == IBV_WC_LOC_PROT_ERR);
  CHECK(V.dereg_mr(smr) == 0 && V.dereg_mr(dmr) == 0);
}

// A 64-byte source registered on `a` and a remotely writable 64-byte target on `b`.
struct WritePair {
  std::vector<uint8_t> src = std::vector<uint8_t>(64, 1), dst = std::vector<uint8_t>(64);
  ibv_mr* smr;
  ibv_mr* dmr;
  ibv_sge sge;
  WritePair(Node& a, Node& b)
      : smr(V.reg_mr(a.pd, src.data(), 64, IBV_ACCESS_LOCAL_WRITE)),
        dmr(V.reg_mr(b.pd, dst.data(), 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE)),
        sge{reinterpret_cast<uint64_t>(src.data()), 64, smr->lkey} {}
  ibv_send_wr wr(bool signaled, uint64_t wr_id) {
    return write_wr(&sge, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, false, signaled, wr_id);
  }
  void release() { CHECK(V.dereg_mr(smr) == 0 && V.dereg_mr(dmr) == 0); }
};

void selective_signaling() {
  Node a(4), b;
  connect(a, b);
  WritePair pair(a, b);
  ibv_send_wr* bad = nullptr;
  // Four unsignaled WRs hold all four slots even after they completed on the wire.
  for (int i = 0; i < 4; ++i) {
    ibv_send_wr w = pair.wr(false, i);
    CHECK(V.post_send(a.qp, &w, &bad) == 0);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ibv_send_wr w = pair.wr(true, 99);
  CHECK(V.post_send(a.qp, &w, &bad) == ENOMEM);
  expect_no_more(a.cq);
  pair.release();
}

void signaled_frees_slots() {
  Node a(4), b;
  connect(a, b);
  WritePair pair(a, b);
  ibv_send_wr* bad = nullptr;
  for (int round = 0; round < 3; ++round) {
    for (int i = 0; i < 4; ++i) {
      ibv_send_wr w = pair.wr(i == 3, round * 10 + i);
      CHECK(V.post_send(a.qp, &w, &bad) == 0);
    }
    auto wcs = poll_n(a.cq, 1);
    CHECK(wcs[0].status == IBV_WC_SUCCESS && wcs[0].wr_id == static_cast<uint64_t>(round * 10 + 3));
  }
  expect_no_more(a.cq);
  pair.release();
}

// The responder QP is destroyed (its process vanished): writes end in a transport retry error
// once (retry_cnt + 1) ACK timeouts passed. timeout 12: 16.8 ms, three tries: ~50 ms.
void vanished_peer() {
  Node a;
  auto* b = new Node();
  connect(a, *b, 12);
  std::vector<uint8_t> src(64, 1), dst(64);
  ibv_mr* smr = V.reg_mr(a.pd, src.data(), 64, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = V.reg_mr(b->pd, dst.data(), 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  const uint32_t rkey = dmr->rkey;
  CHECK(V.dereg_mr(dmr) == 0);
  delete b;  // QP, CQ, PD and device gone: nothing listens at its LID any more
  ibv_sge s{reinterpret_cast<uint64_t>(src.data()), 64, smr->lkey};
  ibv_send_wr w = write_wr(&s, reinterpret_cast<uint64_t>(dst.data()), rkey, false, true, 3);
  ibv_send_wr* bad = nullptr;
  const auto t0 = std::chrono::steady_clock::now();
  CHECK(V.post_send(a.qp, &w, &bad) == 0);
  auto wcs = poll_n(a.cq, 1);
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  CHECK(wcs[0].status == IBV_WC_RETRY_EXC_ERR);
  CHECK(ms >= 40);  // it waited out the ACK timeouts rather than failing at once
  CHECK(V.dereg_mr(smr) == 0);
}

void psn_mismatch() {
  Node a, b;
  connect(a, b, 12, /*psn_skew=*/5);
  std::vector<uint8_t> src(64, 1), dst(64, 0);
  ibv_mr* smr = V.reg_mr(a.pd, src.data(), 64, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = V.reg_mr(b.pd, dst.data(), 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ibv_sge s{reinterpret_cast<uint64_t>(src.data()), 64, smr->lkey};
  ibv_send_wr w = write_wr(&s, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, false, true, 3);
  ibv_send_wr* bad = nullptr;
  CHECK(V.post_send(a.qp, &w, &bad) == 0);
  CHECK(poll_n(a.cq, 1)[0].status == IBV_WC_RETRY_EXC_ERR);
  for (uint8_t v : dst) CHECK(v == 0);
  CHECK(V.dereg_mr(smr) == 0 && V.dereg_mr(dmr) == 0);
}

void rnr() {
  Node a, b;
  connect(a, b);
  std::vector<uint8_t> src(64, 1), dst(64, 0);
  ibv_mr* smr = V.reg_mr(a.pd, src.data(), 64, IBV_ACCESS_LOCAL_WRITE);
  ibv_mr* dmr = V.reg_mr(b.pd, dst.data(), 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  ibv_sge s{reinterpret_cast<uint64_t>(src.data()), 64, smr->lkey};
  ibv_send_wr w = write_wr(&s, reinterpret_cast<uint64_t>(dst.data()), dmr->rkey, true, true, 3);
  ibv_send_wr* bad = nullptr;
  CHECK(V.post_send(a.qp, &w, &bad) == 0);  // no receive posted at b
  CHECK(poll_n(a.cq, 1)[0].status == IBV_WC_RNR_RETRY_EXC_ERR);
  CHECK(V.dereg_mr(smr) == 0 && V.dereg_mr(dmr) == 0);
}

void teardown() {
  {
    Node a;
    std::vector<uint8_t> buf(64);
    ibv_mr* mr = V.reg_mr(a.pd, buf.data(), 64, IBV_ACCESS_LOCAL_WRITE);
    CHECK(V.reg_mr(a.pd, buf.data(), 64, IBV_ACCESS_REMOTE_WRITE) == nullptr);  // needs LOCAL_WRITE
    CHECK(V.dealloc_pd(a.pd) == EBUSY);   // an MR and a QP still use it
    CHECK(V.destroy_cq(a.cq) == EBUSY);   // the QP still uses it
    CHECK(V.close_device(a.ctx) == EBUSY);
    auto c = emu::counters();
    CHECK(c.contexts == 1 && c.pds == 1 && c.mrs == 1 && c.cqs == 1 && c.qps == 1);
    CHECK(V.dereg_mr(mr) == 0);
  }
  auto c = emu::counters();
  CHECK(c.contexts == 0 && c.pds == 0 && c.mrs == 0 && c.cqs == 0 && c.qps == 0);
}

}  // namespace

int main(int argc, char** argv) {
  const std::map<std::string, std::function<void()>> cases = {
      {"state_machine", state_machine},
      {"write_chain", write_chain},
      {"bad_rkey", [] { remote_access_error("bad_rkey"); }},
      {"out_of_range", [] { remote_access_error("out_of_range"); }},
      {"before_start", [] { remote_access_error("before_start"); }},
      {"no_remote_write", [] { remote_access_error("no_remote_write"); }},
      {"bad_lkey", bad_lkey},
      {"selective_signaling", selective_signaling},
      {"signaled_frees_slots", signaled_frees_slots},
      {"vanished_peer", vanished_peer},
      {"psn_mismatch", psn_mismatch},
      {"rnr", rnr},
      {"teardown", teardown},
  };
  return run_case_main(argc, argv, cases, [] {
    const auto c = emu::counters();
    CHECK(c.contexts == 0 && c.pds == 0 && c.mrs == 0 && c.cqs == 0 && c.qps == 0);  // nothing leaked
  });
}
