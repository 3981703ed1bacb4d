#include "verbs_emulator.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <random>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../../socket.h"
#include "pddcore/transfer_backend.h"
#include "pddcore/wire.h"

namespace pddcore::rdma::emulator {
namespace {

using transfer::now_ns;
using transfer::Socket;

constexpr uint32_t kWriteMagic = 0x57554D45;  // "EMUW"
constexpr uint32_t kAckMagic = 0x41554D45;    // "EMUA"
constexpr uint32_t kPsnMask = 0xFFFFFF;
constexpr size_t kWriteHeaderBytes = 48;
constexpr size_t kAckBytes = 12;
constexpr uint32_t kMaxWr = 16384;
constexpr uint32_t kMaxSge = 16;
constexpr int kMaxCqe = 1 << 22;
constexpr uint64_t kMaxMessage = 1ull << 31;
constexpr int kAccessKnown =
    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

enum class Syndrome : uint8_t { kAck = 0, kRemoteAccess = 1, kReceiverNotReady = 2 };

struct GlobalCounters {
  std::atomic<int64_t> contexts{0}, pds{0}, mrs{0}, cqs{0}, qps{0}, connections{0};
  std::atomic<uint64_t> writes_placed{0}, bytes_placed{0}, writes_rejected{0};
} g_counters;

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

ibv_device* emulated_device() {
  static ibv_device device = [] {
    ibv_device d{};
    d.node_type = IBV_NODE_CA;
    d.transport_type = IBV_TRANSPORT_IB;
    std::snprintf(d.name, sizeof(d.name), "verbs-emulator0");
    std::snprintf(d.dev_name, sizeof(d.dev_name), "verbs-emulator0");
    return d;
  }();
  return &device;
}

void push_completion(Cq* cq, const ibv_wc& wc) {
  std::lock_guard<std::mutex> lock(cq->mutex);
  if (cq->entries.size() >= cq->capacity) {
    cq->overrun = true;  // as on hardware, a CQ overrun loses completions; poll_cq reports it
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

void wake(const Qp& q) {
  const uint64_t one = 1;
  if (q.wake_fd >= 0) (void)::write(q.wake_fd, &one, sizeof(one));
}

// Moves the QP to the error state. The WR at `failed` (an index into the send queue, or
// npos for none) completes with `status`; every later send WR and every posted receive
// completes with IBV_WC_WR_FLUSH_ERR. WRs before it already succeeded.
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

// Checks that every SGE lies inside a local MR of the QP's PD (the lkey check).
bool local_access_ok(Context& c, const Pd* pd, const std::vector<ibv_sge>& sge) {
  std::lock_guard<std::mutex> lock(c.mutex);
  for (const ibv_sge& s : sge) {
    auto it = c.mrs.find(s.lkey);
    if (it == c.mrs.end() || it->second->pd != pd) return false;
    const ibv_mr& mr = it->second->handle.verbs;
    const uint64_t start = reinterpret_cast<uint64_t>(mr.addr);
    if (s.addr < start || s.addr - start > mr.length || s.length > mr.length - (s.addr - start)) return false;
  }
  return true;
}

// ---------------------------------------------------------------- requester (one thread per RTS QP)

void send_packet(const Socket& link, const Qp& q, const SendWqe& w) {
  uint8_t header[kWriteHeaderBytes] = {};
  wire::Writer(header)
      .put(kWriteMagic)
      .put(static_cast<uint8_t>(w.with_imm))
      .put(q.rnr_retry)
      .put(uint16_t{0})
      .put(w.psn)
      .put(w.packets)
      .put(q.dest_qpn)
      .put(q.handle.verbs.qp_num)
      .put(w.rkey)
      .put(w.imm)
      .put(w.remote_addr)
      .put(w.length);
  std::vector<iovec> iov;
  iov.push_back({header, sizeof(header)});
  for (const ibv_sge& s : w.sge) iov.push_back({reinterpret_cast<void*>(s.addr), s.length});
  link.sendv_all(iov.data(), static_cast<int>(iov.size()));
}

int64_t ack_timeout_ns(const Qp& q) {
  if (q.timeout == 0) return 0;  // IB: 0 means no ACK timeout
  return static_cast<int64_t>(4096) << q.timeout;
}

void requester_loop(Qp* q) {
  Context& c = *q->context;
  Socket link;
  int64_t next_dial_ns = 0;
  bool resend_all = false;
  std::vector<uint8_t> pending;  // response bytes not yet parsed
  for (;;) {
    if (!link.valid() && now_ns() >= next_dial_ns) {
      uint16_t lid;
      {
        std::lock_guard<std::mutex> lock(q->mutex);
        lid = q->dest_lid;
      }
      try {
        link = transfer::dial_tcp({"127.0.0.1", lid}, 1.0);
        link.set_nodelay();
        link.set_timeouts(0, 5.0);
        g_counters.connections++;
        pending.clear();
        resend_all = true;
      } catch (const std::exception&) {
        next_dial_ns = now_ns() + 20'000'000;  // nobody at that LID: WRs time out as on a fabric
      }
    }
    std::vector<SendWqe> batch;
    int64_t next_deadline = 0;
    {
      std::lock_guard<std::mutex> lock(q->mutex);
      if (q->requester_stop) break;
      if (q->state == IBV_QPS_RTS) {
        const int64_t now = now_ns();
        const int64_t budget = ack_timeout_ns(*q) * (q->retry_cnt + 1);
        for (size_t i = 0; i < q->send_queue.size(); ++i) {
          SendWqe& w = q->send_queue[i];
          if (w.acked) continue;
          if (w.sent && w.deadline_ns != 0 && now >= w.deadline_ns) {
            enter_error_locked(*q, i, IBV_WC_RETRY_EXC_ERR);
            break;
          }
          if (!w.sent || resend_all) {
            if (!w.sent) w.deadline_ns = budget == 0 ? 0 : now + budget;
            w.sent = true;
            if (link.valid()) batch.push_back(w);
          }
          if (w.deadline_ns != 0 && (next_deadline == 0 || w.deadline_ns < next_deadline))
            next_deadline = w.deadline_ns;
        }
        resend_all = false;
      }
    }
    // Payloads are read from registered memory under the shared memory lock, after the lkey check.
    for (const SendWqe& w : batch) {
      std::shared_lock<std::shared_mutex> memory(c.memory);
      if (!local_access_ok(c, q->pd, w.sge)) {
        std::lock_guard<std::mutex> lock(q->mutex);
        const size_t i = find_psn_locked(*q, w.psn);
        if (i != std::string::npos) enter_error_locked(*q, i, IBV_WC_LOC_PROT_ERR);
        break;
      }
      try {
        send_packet(link, *q, w);
      } catch (const std::exception&) {
        link = Socket();  // unacknowledged WRs go again on the next link, or time out
        g_counters.connections--;
        break;
      }
    }

    int64_t wait_ms = 50;
    if (next_deadline != 0)
      wait_ms = std::max<int64_t>(1, std::min<int64_t>(wait_ms, (next_deadline - now_ns()) / 1000000 + 1));
    pollfd fds[2] = {{q->wake_fd, POLLIN, 0}, {link.valid() ? link.fd() : -1, POLLIN, 0}};
    if (!link.valid()) wait_ms = std::min<int64_t>(wait_ms, 20);
    ::poll(fds, 2, static_cast<int>(wait_ms));
    if (fds[0].revents & POLLIN) {
      uint64_t n;
      (void)::read(q->wake_fd, &n, sizeof(n));
    }
    if (link.valid() && (fds[1].revents & (POLLIN | POLLHUP | POLLERR))) {
      uint8_t buf[4096];
      const ssize_t got = ::recv(link.fd(), buf, sizeof(buf), MSG_DONTWAIT);
      if (got <= 0 && !(got < 0 && (errno == EAGAIN || errno == EINTR))) {
        link = Socket();
        g_counters.connections--;
      } else if (got > 0) {
        pending.insert(pending.end(), buf, buf + got);
        size_t used = 0;
        std::lock_guard<std::mutex> lock(q->mutex);
        for (; pending.size() - used >= kAckBytes; used += kAckBytes) {
          wire::Reader r(pending.data() + used);
          if (r.get<uint32_t>() != kAckMagic) break;
          const auto syndrome = static_cast<Syndrome>(r.get<uint8_t>());
          r.get<uint8_t>();
          r.get<uint16_t>();
          handle_response_locked(*q, syndrome, r.get<uint32_t>());
        }
        pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(used));
      }
    }
  }
  if (link.valid()) g_counters.connections--;
}

// ---------------------------------------------------------------- responder (one thread per wire connection)

// The IB minimum RNR NAK timer values (ms), indexed by min_rnr_timer.
constexpr double kRnrTimerMs[32] = {655.36, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.12, 0.16, 0.24, 0.32,
                                    0.48,   0.64, 0.96, 1.28, 1.92, 2.56, 3.84, 5.12, 7.68, 10.24, 15.36,
                                    20.48,  30.72, 40.96, 61.44, 81.92, 122.88, 163.84, 245.76, 327.68, 491.52};

void discard(const Socket& s, uint64_t n) {
  uint8_t sink[65536];
  while (n > 0) {
    const size_t part = std::min<uint64_t>(n, sizeof(sink));
    s.recv_all(sink, part);
    n -= part;
  }
}

void respond(const Socket& s, Syndrome syndrome, uint32_t psn) {
  uint8_t frame[kAckBytes];
  wire::Writer(frame).put(kAckMagic).put(static_cast<uint8_t>(syndrome)).put(uint8_t{0}).put(uint16_t{0}).put(psn);
  s.send_all(frame, sizeof(frame));
}

struct WritePacket {
  bool with_imm;
  uint8_t rnr_retry;
  uint32_t psn, packets, dst_qpn, src_qpn, rkey, imm;
  uint64_t remote_addr, length;
};

// Waits for a posted receive (the responder side of RNR). True when one is there.
bool await_receive_locked(Qp& q, std::unique_lock<std::mutex>& lock, uint8_t rnr_retry) {
  const bool forever = rnr_retry == 7;  // IB: 7 means retry without limit
  const auto budget = std::chrono::duration<double, std::milli>(kRnrTimerMs[q.min_rnr_timer & 31] * (rnr_retry + 1));
  const auto until = std::chrono::steady_clock::now() + budget;
  while (q.receive_queue.empty()) {
    if (q.state != IBV_QPS_RTR && q.state != IBV_QPS_RTS) return false;
    if (q.destroying || q.context->closing) return false;
    if (!forever && std::chrono::steady_clock::now() >= until) return false;
    q.receive_posted.wait_for(lock, std::chrono::milliseconds(10));
  }
  return true;
}

bool remote_access_ok(Context& c, const Qp& q, const WritePacket& p) {
  if (!(q.access & IBV_ACCESS_REMOTE_WRITE)) return false;
  std::lock_guard<std::mutex> lock(c.mutex);
  auto it = c.mrs.find(p.rkey);
  if (it == c.mrs.end() || it->second->pd != q.pd || !(it->second->access & IBV_ACCESS_REMOTE_WRITE)) return false;
  const ibv_mr& mr = it->second->handle.verbs;
  const uint64_t start = reinterpret_cast<uint64_t>(mr.addr);
  return p.remote_addr >= start && p.remote_addr - start <= mr.length && p.length <= mr.length - (p.remote_addr - start);
}

void handle_write(Context& c, const Socket& s, const WritePacket& p) {
  std::shared_ptr<Qp> qp;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    auto it = c.qps.find(p.dst_qpn);
    if (it != c.qps.end()) qp = it->second;
  }
  if (!qp) return discard(s, p.length);  // no such QP: dropped, the requester times out
  Qp& q = *qp;
  std::lock_guard<std::mutex> in_use(q.in_use);
  if (q.destroyed) return discard(s, p.length);
  std::unique_lock<std::mutex> lock(q.mutex);
  if ((q.state != IBV_QPS_RTR && q.state != IBV_QPS_RTS) || p.src_qpn != q.dest_qpn) {
    lock.unlock();
    return discard(s, p.length);
  }
  const uint32_t behind = (q.expected_psn - p.psn) & kPsnMask;
  if (behind != 0) {
    lock.unlock();
    discard(s, p.length);
    // A duplicate (retransmission) is acknowledged again without executing it twice; a
    // packet ahead of the expected PSN is dropped.
    if (behind < (1u << 23)) respond(s, Syndrome::kAck, p.psn);
    return;
  }
  if (p.with_imm && !await_receive_locked(q, lock, p.rnr_retry)) {
    const bool rnr = q.state == IBV_QPS_RTR || q.state == IBV_QPS_RTS;
    lock.unlock();
    discard(s, p.length);
    if (rnr) respond(s, Syndrome::kReceiverNotReady, p.psn);
    return;
  }
  lock.unlock();
  {
    std::shared_lock<std::shared_mutex> memory(c.memory);
    if (!remote_access_ok(c, q, p)) {
      memory.unlock();
      discard(s, p.length);
      {
        std::lock_guard<std::mutex> relock(q.mutex);
        enter_error_locked(q, std::string::npos, IBV_WC_WR_FLUSH_ERR);
      }
      g_counters.writes_rejected++;
      return respond(s, Syndrome::kRemoteAccess, p.psn);
    }
    s.recv_all(reinterpret_cast<void*>(p.remote_addr), p.length);
  }
  g_counters.writes_placed++;
  g_counters.bytes_placed += p.length;
  {
    std::lock_guard<std::mutex> relock(q.mutex);
    q.expected_psn = (q.expected_psn + p.packets) & kPsnMask;
    if (p.with_imm && !q.receive_queue.empty()) {
      ibv_wc wc{};
      wc.wr_id = q.receive_queue.front();
      q.receive_queue.pop_front();
      wc.status = IBV_WC_SUCCESS;
      wc.opcode = IBV_WC_RECV_RDMA_WITH_IMM;
      wc.byte_len = static_cast<uint32_t>(p.length);
      wc.imm_data = p.imm;
      wc.wc_flags = IBV_WC_WITH_IMM;
      wc.qp_num = q.handle.verbs.qp_num;
      wc.src_qp = p.src_qpn;
      push_completion(q.recv_cq, wc);
    }
  }
  respond(s, Syndrome::kAck, p.psn);
}

void responder_loop(Context* c, Responder* r) {
  try {
    for (;;) {
      uint8_t header[kWriteHeaderBytes];
      r->socket.recv_all(header, sizeof(header));
      wire::Reader rd(header);
      if (rd.get<uint32_t>() != kWriteMagic) break;
      WritePacket p{};
      p.with_imm = rd.get<uint8_t>() != 0;
      p.rnr_retry = rd.get<uint8_t>();
      rd.get<uint16_t>();
      p.psn = rd.get<uint32_t>();
      p.packets = rd.get<uint32_t>();
      p.dst_qpn = rd.get<uint32_t>();
      p.src_qpn = rd.get<uint32_t>();
      p.rkey = rd.get<uint32_t>();
      p.imm = rd.get<uint32_t>();
      p.remote_addr = rd.get<uint64_t>();
      p.length = rd.get<uint64_t>();
      if (p.length > kMaxMessage) break;
      handle_write(*c, r->socket, p);
    }
  } catch (const std::exception&) {
    // The requester went away; its WRs time out on its side.
  }
  g_counters.connections--;
  r->done = true;
}

void accept_loop(Context* c) {
  while (!c->closing) {
    pollfd pfd{c->listener.fd(), POLLIN, 0};
    if (::poll(&pfd, 1, 100) <= 0) continue;
    const int fd = ::accept4(c->listener.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    std::lock_guard<std::mutex> lock(c->mutex);
    for (auto it = c->responders.begin(); it != c->responders.end();) {
      if ((*it)->done) {
        (*it)->thread.join();
        it = c->responders.erase(it);
      } else {
        ++it;
      }
    }
    auto r = std::make_unique<Responder>();
    r->socket = Socket(fd);
    r->socket.set_nodelay();
    g_counters.connections++;
    Responder* raw = r.get();
    r->thread = std::thread(responder_loop, c, raw);
    c->responders.push_back(std::move(r));
  }
}

// ---------------------------------------------------------------- the verbs

ibv_device** get_device_list(int* num_devices) {
  auto** list = new ibv_device*[2]{emulated_device(), nullptr};
  if (num_devices != nullptr) *num_devices = 1;
  return list;
}

void free_device_list(ibv_device** list) { delete[] list; }

const char* get_device_name(ibv_device* device) { return device->name; }

ibv_context* open_device(ibv_device* device) {
  if (device != emulated_device()) {
    errno = ENODEV;
    return nullptr;
  }
  auto* c = new Context();
  try {
    c->listener = transfer::listen_tcp({"127.0.0.1", 0}, &c->port);
  } catch (const std::exception&) {
    delete c;
    errno = EIO;
    return nullptr;
  }
  std::random_device rd;
  c->next_key = rd() & 0xFFFF00u;
  c->next_qpn = (rd() & 0x7FFF0u) + 0x100;
  c->handle.owner = c;
  c->handle.verbs.device = device;
  c->handle.verbs.cmd_fd = -1;
  c->handle.verbs.async_fd = -1;
  c->handle.verbs.num_comp_vectors = 1;
  c->acceptor = std::thread(accept_loop, c);
  g_counters.contexts++;
  return &c->handle.verbs;
}

int close_device(ibv_context* context) {
  Context* c = owner_of<Context>(context);
  {
    std::lock_guard<std::mutex> lock(c->mutex);
    if (c->children != 0 || !c->mrs.empty() || !c->qps.empty()) return EBUSY;
  }
  c->closing = true;
  c->acceptor.join();
  std::list<std::unique_ptr<Responder>> responders;
  {
    std::lock_guard<std::mutex> lock(c->mutex);
    responders.swap(c->responders);
  }
  for (auto& r : responders) r->socket.shutdown();
  for (auto& r : responders) r->thread.join();
  delete c;
  g_counters.contexts--;
  return 0;
}

int query_port(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) {
  if (port_num != 1) return EINVAL;
  *attr = ibv_port_attr{};
  attr->state = IBV_PORT_ACTIVE;
  attr->max_mtu = IBV_MTU_4096;
  attr->active_mtu = IBV_MTU_4096;
  attr->gid_tbl_len = 1;
  attr->max_msg_sz = static_cast<uint32_t>(kMaxMessage);
  attr->pkey_tbl_len = 1;
  attr->lid = owner_of<Context>(context)->port;  // the wire's loopback port
  attr->link_layer = IBV_LINK_LAYER_INFINIBAND;
  attr->phys_state = 5;  // LinkUp
  return 0;
}

int query_gid(ibv_context*, uint8_t port_num, int index, ibv_gid* gid) {
  if (port_num != 1 || index != 0) return EINVAL;
  *gid = ibv_gid{};
  gid->raw[10] = gid->raw[11] = 0xFF;  // ::ffff:127.0.0.1, IPv4-mapped as RoCEv2 GIDs are
  gid->raw[12] = 127;
  gid->raw[15] = 1;
  return 0;
}

ibv_pd* alloc_pd(ibv_context* context) {
  Context* c = owner_of<Context>(context);
  auto* pd = new Pd();
  pd->handle.owner = pd;
  pd->context = c;
  pd->handle.verbs.context = context;
  std::lock_guard<std::mutex> lock(c->mutex);
  pd->handle.verbs.handle = c->next_key++;
  c->children++;
  g_counters.pds++;
  return &pd->handle.verbs;
}

int dealloc_pd(ibv_pd* handle) {
  Pd* pd = owner_of<Pd>(handle);
  Context* c = pd->context;
  {
    std::lock_guard<std::mutex> lock(c->mutex);
    if (pd->users != 0) return EBUSY;
    c->children--;
  }
  delete pd;
  g_counters.pds--;
  return 0;
}

ibv_mr* reg_mr(ibv_pd* handle, void* addr, size_t length, int access) {
  Pd* pd = owner_of<Pd>(handle);
  Context* c = pd->context;
  // As in verbs: remote write needs local write; unknown flags and null ranges are refused.
  if ((access & ~kAccessKnown) || ((access & IBV_ACCESS_REMOTE_WRITE) && !(access & IBV_ACCESS_LOCAL_WRITE)) ||
      (addr == nullptr && length != 0)) {
    errno = EINVAL;
    return nullptr;
  }
  auto* mr = new Mr();
  mr->handle.owner = mr;
  mr->pd = pd;
  mr->access = access;
  ibv_mr& v = mr->handle.verbs;
  v.context = handle->context;
  v.pd = handle;
  v.addr = addr;
  v.length = length;
  std::unique_lock<std::shared_mutex> memory(c->memory);
  std::lock_guard<std::mutex> lock(c->mutex);
  const uint32_t index = c->next_key++ & 0xFFFFFFu;
  v.lkey = v.rkey = (index << 8) | ((index * 0x9Du) & 0xFF);
  v.handle = v.lkey;
  c->mrs[v.lkey] = mr;
  pd->users++;
  g_counters.mrs++;
  return &v;
}

int dereg_mr(ibv_mr* handle) {
  Mr* mr = owner_of<Mr>(handle);
  Context* c = mr->pd->context;
  {
    std::unique_lock<std::shared_mutex> memory(c->memory);
    std::lock_guard<std::mutex> lock(c->mutex);
    c->mrs.erase(handle->lkey);
    mr->pd->users--;
  }
  delete mr;
  g_counters.mrs--;
  return 0;
}

ibv_cq* create_cq(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel, int comp_vector) {
  if (cqe < 1 || cqe > kMaxCqe || comp_vector != 0) {
    errno = EINVAL;
    return nullptr;
  }
  if (channel != nullptr) {  // completion channels are not emulated: the backend polls
    errno = EOPNOTSUPP;
    return nullptr;
  }
  Context* c = owner_of<Context>(context);
  auto* cq = new Cq();
  cq->handle.owner = cq;
  cq->context = c;
  cq->capacity = static_cast<size_t>(cqe);
  ibv_cq& v = cq->handle.verbs;
  v.context = context;
  v.cq_context = cq_context;
  v.cqe = cqe;
  std::lock_guard<std::mutex> lock(c->mutex);
  c->children++;
  g_counters.cqs++;
  return &v;
}

int destroy_cq(ibv_cq* handle) {
  Cq* cq = owner_of<Cq>(handle);
  {
    std::lock_guard<std::mutex> lock(cq->context->mutex);
    if (cq->users != 0) return EBUSY;
    cq->context->children--;
  }
  delete cq;
  g_counters.cqs--;
  return 0;
}

int poll_cq(ibv_cq* handle, int num_entries, ibv_wc* wc) {
  Cq* cq = owner_of<Cq>(handle);
  std::lock_guard<std::mutex> lock(cq->mutex);
  if (cq->overrun) return -EOVERFLOW;
  int n = 0;
  for (; n < num_entries && !cq->entries.empty(); ++n) {
    wc[n] = cq->entries.front();
    cq->entries.pop_front();
  }
  return n;
}

ibv_qp* create_qp(ibv_pd* pd_handle, ibv_qp_init_attr* attr) {
  Pd* pd = owner_of<Pd>(pd_handle);
  Context* c = pd->context;
  const ibv_qp_cap& cap = attr->cap;
  if (attr->qp_type != IBV_QPT_RC || attr->srq != nullptr) {
    errno = EOPNOTSUPP;  // the emulator models reliable-connected QPs only
    return nullptr;
  }
  if (attr->send_cq == nullptr || attr->recv_cq == nullptr || attr->send_cq->context != pd_handle->context ||
      attr->recv_cq->context != pd_handle->context || cap.max_send_wr == 0 || cap.max_send_wr > kMaxWr ||
      cap.max_recv_wr > kMaxWr || cap.max_send_sge > kMaxSge || cap.max_recv_sge > kMaxSge ||
      cap.max_inline_data > 0) {
    errno = EINVAL;
    return nullptr;
  }
  auto q = std::make_shared<Qp>();
  q->handle.owner = q.get();
  q->context = c;
  q->pd = pd;
  q->send_cq = owner_of<Cq>(attr->send_cq);
  q->recv_cq = owner_of<Cq>(attr->recv_cq);
  q->cap = cap;
  q->signal_all = attr->sq_sig_all != 0;
  q->wake_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  ibv_qp& v = q->handle.verbs;
  v.context = pd_handle->context;
  v.qp_context = attr->qp_context;
  v.pd = pd_handle;
  v.send_cq = attr->send_cq;
  v.recv_cq = attr->recv_cq;
  v.qp_type = IBV_QPT_RC;
  v.state = IBV_QPS_RESET;
  std::lock_guard<std::mutex> lock(c->mutex);
  v.qp_num = c->next_qpn++ & kPsnMask;
  v.handle = v.qp_num;
  c->qps[v.qp_num] = q;
  pd->users++;
  q->send_cq->users++;
  q->recv_cq->users++;
  g_counters.qps++;
  return &v;
}

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

void stop_requester(Qp& q, std::unique_lock<std::mutex>& lock) {
  if (!q.requester.joinable()) return;
  q.requester_stop = true;
  wake(q);
  lock.unlock();
  q.requester.join();
  lock.lock();
  q.requester_stop = false;
}

int modify_qp(ibv_qp* handle, ibv_qp_attr* a, int mask) {
  Qp& q = *owner_of<Qp>(handle);
  std::unique_lock<std::mutex> lock(q.mutex);
  const ibv_qp_state from = q.state;
  if ((mask & IBV_QP_CUR_STATE) && a->cur_qp_state != from) return EINVAL;
  const ibv_qp_state to = (mask & IBV_QP_STATE) ? a->qp_state : from;
  if (to == IBV_QPS_RESET || to == IBV_QPS_ERR) {
    if (mask & ~(IBV_QP_STATE | IBV_QP_CUR_STATE)) return EINVAL;
  } else {
    const Transition* t = find_transition(from, to);
    if (t == nullptr) return EINVAL;
    if ((mask & t->required) != t->required) return EINVAL;
    if (mask & ~(t->required | t->allowed | IBV_QP_STATE)) return EINVAL;
    if (!attributes_valid(*a, mask)) return EINVAL;
  }
  if (mask & IBV_QP_ACCESS_FLAGS) q.access = a->qp_access_flags;
  if (mask & IBV_QP_AV) q.dest_lid = a->ah_attr.dlid;
  if (mask & IBV_QP_PATH_MTU) q.mtu_bytes = 128u << a->path_mtu;
  if (mask & IBV_QP_DEST_QPN) q.dest_qpn = a->dest_qp_num;
  if (mask & IBV_QP_RQ_PSN) q.expected_psn = a->rq_psn & kPsnMask;
  if (mask & IBV_QP_MIN_RNR_TIMER) q.min_rnr_timer = a->min_rnr_timer;
  if (mask & IBV_QP_SQ_PSN) q.next_psn = a->sq_psn & kPsnMask;
  if (mask & IBV_QP_TIMEOUT) q.timeout = a->timeout;
  if (mask & IBV_QP_RETRY_CNT) q.retry_cnt = a->retry_cnt;
  if (mask & IBV_QP_RNR_RETRY) q.rnr_retry = a->rnr_retry;

  if (to == IBV_QPS_RESET) {
    stop_requester(q, lock);
    q.send_queue.clear();  // RESET discards work requests without completing them
    q.receive_queue.clear();
    q.access = 0;
  } else if (to == IBV_QPS_ERR) {
    if (from != IBV_QPS_ERR) enter_error_locked(q, std::string::npos, IBV_WC_WR_FLUSH_ERR);
  } else if (from == IBV_QPS_RTR && to == IBV_QPS_RTS) {
    q.requester = std::thread(requester_loop, &q);
  }
  q.state = to;
  handle->state = to;
  q.receive_posted.notify_all();
  return 0;
}

int destroy_qp(ibv_qp* handle) {
  Qp* raw = owner_of<Qp>(handle);
  Context* c = raw->context;
  raw->destroying = true;
  {
    std::unique_lock<std::mutex> lock(raw->mutex);
    raw->receive_posted.notify_all();
    stop_requester(*raw, lock);
  }
  std::shared_ptr<Qp> q;
  {
    std::lock_guard<std::mutex> lock(c->mutex);
    auto it = c->qps.find(handle->qp_num);
    q = it->second;
    c->qps.erase(it);
    q->pd->users--;
    q->send_cq->users--;
    q->recv_cq->users--;
  }
  {
    std::lock_guard<std::mutex> in_use(q->in_use);  // wait out a responder mid-packet
    q->destroyed = true;
  }
  ::close(q->wake_fd);
  q->wake_fd = -1;
  g_counters.qps--;
  return 0;
}

int post_send(ibv_qp* handle, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  Qp& q = *owner_of<Qp>(handle);
  std::lock_guard<std::mutex> lock(q.mutex);
  for (; wr != nullptr; wr = wr->next) {
    int err = 0;
    if (q.state != IBV_QPS_RTS && q.state != IBV_QPS_ERR) err = EINVAL;
    else if (wr->opcode != IBV_WR_RDMA_WRITE && wr->opcode != IBV_WR_RDMA_WRITE_WITH_IMM) err = EINVAL;
    else if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > q.cap.max_send_sge) err = EINVAL;
    else if (wr->send_flags & IBV_SEND_INLINE) err = EINVAL;
    else if (q.send_queue.size() >= q.cap.max_send_wr) err = ENOMEM;
    SendWqe w;
    w.length = 0;
    if (err == 0) {
      w.sge.assign(wr->sg_list, wr->sg_list + wr->num_sge);
      for (const ibv_sge& s : w.sge) w.length += s.length;
      if (w.length > kMaxMessage) err = EINVAL;
    }
    if (err != 0) {
      *bad_wr = wr;
      return err;
    }
    w.wr_id = wr->wr_id;
    w.with_imm = wr->opcode == IBV_WR_RDMA_WRITE_WITH_IMM;
    w.signaled = q.signal_all || (wr->send_flags & IBV_SEND_SIGNALED);
    w.imm = w.with_imm ? wr->imm_data : 0;
    w.remote_addr = wr->wr.rdma.remote_addr;
    w.rkey = wr->wr.rdma.rkey;
    if (q.state == IBV_QPS_ERR) {  // work posted to a QP in error completes flushed
      push_completion(q.send_cq, send_completion(q, w.wr_id, IBV_WC_WR_FLUSH_ERR));
      continue;
    }
    w.packets = std::max<uint32_t>(1, static_cast<uint32_t>((w.length + q.mtu_bytes - 1) / q.mtu_bytes));
    w.psn = q.next_psn;
    q.next_psn = (q.next_psn + w.packets) & kPsnMask;
    q.send_queue.push_back(std::move(w));
  }
  wake(q);
  return 0;
}

int post_recv(ibv_qp* handle, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  Qp& q = *owner_of<Qp>(handle);
  std::lock_guard<std::mutex> lock(q.mutex);
  for (; wr != nullptr; wr = wr->next) {
    int err = 0;
    if (q.state == IBV_QPS_RESET) err = EINVAL;
    else if (wr->num_sge < 0 || static_cast<uint32_t>(wr->num_sge) > q.cap.max_recv_sge) err = EINVAL;
    else if (q.receive_queue.size() >= q.cap.max_recv_wr) err = ENOMEM;
    if (err != 0) {
      *bad_wr = wr;
      return err;
    }
    if (q.state == IBV_QPS_ERR) {
      ibv_wc wc{};
      wc.wr_id = wr->wr_id;
      wc.status = IBV_WC_WR_FLUSH_ERR;
      wc.opcode = IBV_WC_RECV;
      wc.qp_num = handle->qp_num;
      push_completion(q.recv_cq, wc);
      continue;
    }
    q.receive_queue.push_back(wr->wr_id);
  }
  q.receive_posted.notify_all();
  return 0;
}

const char* wc_status_str(ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_QP_OP_ERR: return "local QP operation error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "Work Request Flushed Error";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request error";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_REM_OP_ERR: return "remote operation error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    default: return "unknown";
  }
}

}  // namespace

const VerbsTable& verbs() {
  static const VerbsTable table = [] {
    VerbsTable t{};
    t.provider = "verbs emulator";
    t.get_device_list = get_device_list;
    t.free_device_list = free_device_list;
    t.get_device_name = get_device_name;
    t.open_device = open_device;
    t.close_device = close_device;
    t.query_port = query_port;
    t.query_gid = query_gid;
    t.alloc_pd = alloc_pd;
    t.dealloc_pd = dealloc_pd;
    t.reg_mr = reg_mr;
    t.dereg_mr = dereg_mr;
    t.create_cq = create_cq;
    t.destroy_cq = destroy_cq;
    t.create_qp = create_qp;
    t.modify_qp = modify_qp;
    t.destroy_qp = destroy_qp;
    t.post_send = post_send;
    t.post_recv = post_recv;
    t.poll_cq = poll_cq;
    t.wc_status_str = wc_status_str;
    return t;
  }();
  return table;
}

Counters counters() {
  Counters c;
  c.contexts = g_counters.contexts;
  c.pds = g_counters.pds;
  c.mrs = g_counters.mrs;
  c.cqs = g_counters.cqs;
  c.qps = g_counters.qps;
  c.wire_connections = g_counters.connections;
  c.writes_placed = g_counters.writes_placed;
  c.bytes_placed = g_counters.bytes_placed;
  c.writes_rejected = g_counters.writes_rejected;
  return c;
}

}  // namespace pddcore::rdma::emulator

extern "C" __attribute__((visibility("default"))) const pddcore::rdma::VerbsTable* pddcore_verbs_emulator_table() {
  return &pddcore::rdma::emulator::verbs();
}
