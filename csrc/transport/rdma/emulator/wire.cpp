// The verbs emulator's wire: requester and responder threads over loopback TCP.
#include "wire.h"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <string>

#include "pddcore/transfer_backend.h"
#include "pddcore/wire.h"
#include "qp_state.h"

namespace pddcore::rdma::emulator {
namespace {

using transfer::now_ns;

constexpr uint32_t kWriteMagic = 0x57554D45;  // "EMUW"
constexpr uint32_t kAckMagic = 0x41554D45;    // "EMUA"
constexpr size_t kWriteHeaderBytes = 48;
constexpr size_t kAckBytes = 12;

// ---------------------------------------------------------------- requester (one thread per RTS QP)

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

}  // namespace

void start_responders(Context& c) { c.acceptor = std::thread(accept_loop, &c); }

void stop_responders(Context& c) {
  c.closing = true;
  c.acceptor.join();
  std::list<std::unique_ptr<Responder>> responders;
  {
    std::lock_guard<std::mutex> lock(c.mutex);
    responders.swap(c.responders);
  }
  for (auto& r : responders) r->socket.shutdown();
  for (auto& r : responders) r->thread.join();
}

void start_requester(Qp& q) { q.requester = std::thread(requester_loop, &q); }

void stop_requester(Qp& q, std::unique_lock<std::mutex>& lock) {
  if (!q.requester.joinable()) return;
  q.requester_stop = true;
  wake(q);
  lock.unlock();
  q.requester.join();
  lock.lock();
  q.requester_stop = false;
}

void wake(const Qp& q) {
  const uint64_t one = 1;
  if (q.wake_fd >= 0) (void)::write(q.wake_fd, &one, sizeof(one));
}

}  // namespace pddcore::rdma::emulator
