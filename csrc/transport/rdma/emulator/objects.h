// The verbs emulator's objects (see verbs_emulator.h for what it models): the C structs it
// hands to the application and the emulator state behind each, the limits it enforces,
// the process-wide counters, and the completion queue's one operation used everywhere.
// Internal to the emulator: the QP state machine (qp_state.h), the wire (wire.h) and the
// verbs (verbs_emulator.cpp) share these.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../../socket.h"
#include "../verbs_table.h"

namespace pddcore::rdma::emulator {

using transfer::Socket;

constexpr uint32_t kPsnMask = 0xFFFFFF;
constexpr uint32_t kMaxWr = 16384;
constexpr uint32_t kMaxSge = 16;
constexpr int kMaxCqe = 1 << 22;
constexpr uint64_t kMaxMessage = 1ull << 31;
constexpr int kAccessKnown =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

struct GlobalCounters {
  std::atomic<int64_t> contexts{0}, pds{0}, mrs{0}, cqs{0}, qps{0}, connections{0};
  std::atomic<uint64_t> writes_placed{0}, bytes_placed{0}, writes_rejected{0};
};
extern GlobalCounters g_counters;

// A verbs object as handed to the application: the C struct first (standard layout, so a
// pointer to it converts back to the handle), then the emulator object that owns it.
template <typename Verbs, typename Owner>
struct Handle {
  Verbs verbs{};
  Owner* owner = nullptr;
};
template <typename Owner, typename Verbs>
Owner* owner_of(Verbs* v) {
  return reinterpret_cast<Handle<Verbs, Owner>*>(v)->owner;
}

struct Context;
struct Qp;

struct Pd {
  Handle<ibv_pd, Pd> handle;
  Context* context;
  int users = 0;  // MRs and QPs; under Context::mutex
};

struct Mr {
  Handle<ibv_mr, Mr> handle;
  Pd* pd;
  int access;
};

struct Cq {
  Handle<ibv_cq, Cq> handle;
  Context* context;
  std::mutex mutex;
  std::deque<ibv_wc> entries;
  size_t capacity;
  bool overrun = false;
  int users = 0;  // QPs; under Context::mutex
};

// One posted send work request.
struct SendWqe {
  uint64_t wr_id;
  bool with_imm;
  bool signaled;
  uint32_t imm;  // as posted (network order)
  std::vector<ibv_sge> sge;
  uint64_t remote_addr;
  uint32_t rkey;
  uint64_t length;
  uint32_t psn = 0;
  uint32_t packets = 1;
  bool sent = false;   // handed to the wire at least once
  bool acked = false;  // done, kept only while it holds its send-queue slot (unsignaled)
  int64_t deadline_ns = 0;
};

struct Responder {
  Socket socket;
  std::thread thread;
  std::atomic<bool> done{false};
};

struct Context {
  Handle<ibv_context, Context> handle;
  Socket listener;
  uint16_t port = 0;
  std::thread acceptor;
  std::atomic<bool> closing{false};
  // Shared while a payload is read from or placed into registered memory, exclusive while
  // an MR is deregistered: after ibv_dereg_mr returns, the emulator touches none of it.
  std::shared_mutex memory;
  std::mutex mutex;  // guards everything below
  std::unordered_map<uint32_t, Mr*> mrs;  // by key (lkey == rkey)
  std::unordered_map<uint32_t, std::shared_ptr<Qp>> qps;
  std::list<std::unique_ptr<Responder>> responders;
  uint32_t next_key;
  uint32_t next_qpn;
  int children = 0;  // PDs and CQs
};

struct Qp {
  Handle<ibv_qp, Qp> handle;
  Context* context;
  Pd* pd;
  Cq* send_cq;
  Cq* recv_cq;
  ibv_qp_cap cap;
  bool signal_all;

  std::mutex mutex;  // guards everything below
  ibv_qp_state state = IBV_QPS_RESET;
  int access = 0;
  uint16_t dest_lid = 0;
  uint32_t dest_qpn = 0;
  uint32_t expected_psn = 0;
  uint32_t mtu_bytes = 256;
  uint8_t min_rnr_timer = 0;
  uint32_t next_psn = 0;
  uint8_t timeout = 0;
  uint8_t retry_cnt = 0;
  uint8_t rnr_retry = 0;
  std::deque<SendWqe> send_queue;     // posted and not yet retired
  std::deque<uint64_t> receive_queue;  // wr_ids of posted receives
  std::condition_variable receive_posted;
  bool requester_stop = false;
  std::thread requester;
  int wake_fd = -1;

  std::atomic<bool> destroying{false};
  std::mutex in_use;  // held by a responder while it handles a packet for this QP
  bool destroyed = false;  // under in_use
};

// Appends a completion; a full CQ overruns, as on hardware (poll_cq reports it).
void push_completion(Cq* cq, const ibv_wc& wc);

// The completion of the send WR `wr_id` of `q`.
ibv_wc send_completion(const Qp& q, uint64_t wr_id, ibv_wc_status status);

}  // namespace pddcore::rdma::emulator
