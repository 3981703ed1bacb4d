#include "rdma_backend.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <stdexcept>

#include "../framing.h"
#include "../peer_links.h"

namespace pddcore::rdma {

using transfer::BackendHost;
using transfer::PeerInfo;
using transfer::RegionPtr;
using transfer::Socket;
using transfer::TransferError;
using transfer::TransferPtr;
using transfer::TransferState;
using transfer::WriteChunk;

namespace {

constexpr uint64_t kMaxImmBytes = 0xFFFFFFFFull;

void send_setup(const Socket& s, setup::Type type, const std::string& payload) {
  setup::Header header;
  header.type = type;
  header.length = static_cast<uint32_t>(payload.size());
  transfer::send_frame(s, header, payload);
}

std::pair<setup::Type, std::string> recv_setup(const Socket& s) {
  setup::Header header;
  std::string payload;
  transfer::recv_frame(s, &header, &payload, "RDMA setup frame");
  return {header.type, std::move(payload)};
}

}  // namespace

RdmaBackend::RdmaBackend(BackendHost& host, const DeviceChoice& choice)
    : host_(host),
      device_(std::make_unique<VerbsDevice>(choice)),
      qps_per_peer_(std::clamp<uint32_t>(host.options().streams, 1, setup::kMaxQps)),
      rate_limited_(host.options().rate_limit_bps > 0) {
  progress_ = std::thread([this] { progress_loop(); });
  if (rate_limited_) pacer_ = std::thread([this] { pacer_loop(); });
}

RdmaBackend::~RdmaBackend() { close(); }

std::string RdmaBackend::device_description() const {
  return device_->name() + " via " + device_->verbs().provider;
}

// ---- memory ------------------------------------------------------------------

void RdmaBackend::register_memory(const RegionPtr& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw TransferError("engine is closed");
  // A source gets no remote access at all: the NIC itself refuses writes into it.
  const int access = IBV_ACCESS_LOCAL_WRITE | (region->target ? IBV_ACCESS_REMOTE_WRITE : 0);
  ibv_mr* mr = device_->verbs().reg_mr(device_->pd(), region->base, region->size, access);
  if (mr == nullptr)
    throw TransferError("ibv_reg_mr of " + std::to_string(region->size) + " bytes failed: " + std::strerror(errno));
  regions_[region->id] = LocalRegion{mr, region->target};
}

void RdmaBackend::deregister_memory(uint64_t region_id) {
  // The NIC may still read a region that posted WRs point into: wait until none does.
  const int64_t deadline = transfer::now_ns() + static_cast<int64_t>(host_.options().timeout_s * 1e9);
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      bool in_use = false;
      for (auto& [key, link] : links_)
        for (auto& ep : link->endpoints)
          for (const Posted& p : ep->posted) in_use = in_use || (p.chunk.src && p.chunk.src->id == region_id);
      if (!in_use || closed_ || transfer::now_ns() > deadline) {
        auto it = regions_.find(region_id);
        if (it == regions_.end()) return;
        device_->verbs().dereg_mr(it->second.mr);
        regions_.erase(it);
        return;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// ---- sender: connections -----------------------------------------------------

std::vector<std::unique_ptr<RdmaBackend::Endpoint>> RdmaBackend::open_endpoints(Link& link, uint32_t n) {
  std::vector<std::unique_ptr<Endpoint>> eps;
  std::vector<setup::QpAttributes> local;
  for (uint32_t i = 0; i < n; ++i) {
    auto ep = std::make_unique<Endpoint>();
    ep->qp = std::make_unique<QueuePair>(*device_, kSendDepth, 0);
    local.push_back(ep->qp->local());
    eps.push_back(std::move(ep));
  }
  std::pair<setup::Type, std::string> reply;
  {
    std::lock_guard<std::mutex> lock(link.setup_mutex);
    send_setup(link.setup, setup::Type::kQpRequest, setup::encode_qps(local));
    reply = recv_setup(link.setup);
  }
  if (reply.first == setup::Type::kError) throw TransferError("peer refused RDMA QPs: " + reply.second);
  const std::vector<setup::QpAttributes> remote = setup::decode_qps(reply.second);
  if (reply.first != setup::Type::kQpReply || remote.size() != n)
    throw TransferError("malformed RDMA QP reply from " + link.peer.address);
  for (uint32_t i = 0; i < n; ++i) {
    eps[i]->qp->connect(remote[i], host_.options().timeout_s, /*sends=*/true);
    eps[i]->remote_qpn = remote[i].qpn;
  }
  return eps;
}

void RdmaBackend::connect(const PeerInfo& peer) {
  auto link = std::make_shared<Link>();
  link->peer = peer;
  link->setup = host_.dial(peer, wire::ConnKind::kRdmaSetup, 0, nullptr);
  // Twice timeout_s: a silent peer is reported by the engine's no-progress deadline first.
  link->setup.set_timeouts(2 * host_.options().timeout_s, 2 * host_.options().timeout_s);
  link->setup.set_nodelay();
  std::vector<std::unique_ptr<Endpoint>> eps;
  try {
    eps = open_endpoints(*link, qps_per_peer_);
  } catch (const std::exception& e) {
    throw TransferError("RDMA setup with " + peer.address + " failed (does that engine have the rdma backend?): " +
                        e.what());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw TransferError("engine is closed");
  link->endpoints = std::move(eps);
  links_[peer.key] = link;
  link->resolver = std::thread([this, link] { resolve_loop(link); });
}

void RdmaBackend::disconnect(uint64_t peer_key) {
  LinkPtr link = transfer::take_peer_link(mutex_, links_, peer_key);
  if (!link) return;
  // The core fails the peer's transfers; destroying the QPs stops the NIC first.
  link->setup.shutdown();
  stop_resolver(*link);
  std::lock_guard<std::mutex> lock(mutex_);
  link->dead = "peer disconnected";
  link->endpoints.clear();
}

RdmaBackend::LinkPtr RdmaBackend::find_link(uint64_t peer_key) { return transfer::find_peer_link(mutex_, links_, peer_key); }

setup::RegionKey RdmaBackend::remote_region(Link& link, uint64_t region_id, uint64_t offset, uint64_t length) {
  std::lock_guard<std::mutex> setup_lock(link.setup_mutex);
  if (auto it = link.remote_regions.find(region_id); it != link.remote_regions.end()) {
    setup::RegionKey key = it->second;
    key.status = key.contains(offset, length) ? wire::AckStatus::kOk : wire::AckStatus::kOutOfBounds;
    return key;
  }
  setup::RegionQuery query{region_id, offset, length};
  std::string payload(setup::RegionQuery::kSize, '\0');
  query.encode(reinterpret_cast<uint8_t*>(payload.data()));
  send_setup(link.setup, setup::Type::kRegionQuery, payload);
  auto [type, reply] = recv_setup(link.setup);
  if (type != setup::Type::kRegionReply || reply.size() != setup::RegionKey::kSize)
    throw TransferError("malformed RDMA region reply from " + link.peer.address);
  setup::RegionKey key;
  key.decode(reinterpret_cast<const uint8_t*>(reply.data()));
  if (key.known()) {
    std::lock_guard<std::mutex> lock(mutex_);
    link.remote_regions[region_id] = key;
  }
  return key;
}

// ---- sender: writes ----------------------------------------------------------

std::string RdmaBackend::verdict(const setup::RegionKey& key, const WriteChunk& c) {
  wire::AckStatus status = wire::AckStatus::kOk;
  if (key.status == wire::AckStatus::kNotATarget)
    status = key.status;
  else if (!key.known())
    status = wire::AckStatus::kUnknownRegion;
  else if (!key.contains(c.dst_offset, c.length))
    status = wire::AckStatus::kOutOfBounds;
  if (status == wire::AckStatus::kOk) return {};
  return "peer rejected a chunk: " + std::string(wire::to_string(status)) + " (" + describe(c) + ")";
}

void RdmaBackend::post(uint64_t peer_key, std::vector<WriteChunk> chunks) {
  if (chunks.empty()) return;
  LinkPtr link = find_link(peer_key);
  if (!link) return host_.transfer_failed(chunks.front().transfer, "peer is not connected over RDMA");
  Failures failures;
  std::vector<Callback> callbacks;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Known destinations are checked here; a batch naming a region not seen yet goes to
    // the link's resolver thread, which asks the peer (and keeps batches in order).
    std::vector<std::string> verdicts;
    bool known = link->unresolved.empty() && !link->resolving;
    for (size_t i = 0; known && i < chunks.size(); ++i) {
      auto it = link->remote_regions.find(chunks[i].dst_region);
      known = it != link->remote_regions.end();
      if (known) verdicts.push_back(verdict(it->second, chunks[i]));
    }
    if (known) {
      admit_locked(*link, chunks, verdicts, failures, callbacks);
    } else {
      link->unresolved.push_back(std::move(chunks));
      link->resolve_cv.notify_one();
    }
  }
  for (auto& [transfer, why] : failures) host_.transfer_failed(transfer, why);
  for (auto& cb : callbacks) cb();
}

void RdmaBackend::admit_locked(Link& link, std::vector<WriteChunk>& chunks, const std::vector<std::string>& verdicts,
                               Failures& failures, std::vector<Callback>& callbacks) {
  // A transfer with any rejected chunk is dropped whole, before any of it is posted.
  std::set<const TransferState*> rejected;
  for (size_t i = 0; i < chunks.size(); ++i)
    if (!verdicts[i].empty() && rejected.insert(chunks[i].transfer.get()).second)
      failures.emplace_back(chunks[i].transfer, verdicts[i]);
  const std::string dead = !link.dead.empty() ? link.dead : link.endpoints.empty() ? "engine is closed" : "";
  if (!dead.empty()) {
    for (const WriteChunk& c : chunks)
      if (rejected.insert(c.transfer.get()).second) failures.emplace_back(c.transfer, dead);
    return;
  }
  // A transfer stays on one QP, so its last WR (the immediate) follows all of its data.
  Endpoint& ep = *link.endpoints[link.next_endpoint++ % link.endpoints.size()];
  uint64_t bytes = 0;
  for (WriteChunk& c : chunks) {
    if (rejected.count(c.transfer.get())) continue;
    bytes += c.length;
    ep.pending.push_back(std::move(c));
  }
  add_demand(bytes);
  pump(link, ep, callbacks);
}

void RdmaBackend::resolve_loop(const LinkPtr& link) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    link->resolve_cv.wait(lock, [&] { return link->stop_resolver || !link->unresolved.empty(); });
    if (link->stop_resolver) return;
    std::vector<WriteChunk> chunks = std::move(link->unresolved.front());
    link->unresolved.pop_front();
    link->resolving = true;
    lock.unlock();
    // The peer checks the first write into each region it is asked about (and counts a
    // refusal, as a TCP receiver counts a rejected chunk); later ones are checked against
    // the table it returned, and by the NIC (a stale rkey: remote access error).
    std::vector<std::string> verdicts;
    for (const WriteChunk& c : chunks) {
      try {
        verdicts.push_back(verdict(remote_region(*link, c.dst_region, c.dst_offset, c.length), c));
      } catch (const std::exception& e) {
        verdicts.push_back(std::string("RDMA setup connection to ") + link->peer.address + " failed: " + e.what());
      }
    }
    Failures failures;
    std::vector<Callback> callbacks;
    lock.lock();
    admit_locked(*link, chunks, verdicts, failures, callbacks);
    link->resolving = false;
    lock.unlock();
    for (auto& [transfer, why] : failures) host_.transfer_failed(transfer, why);
    for (auto& cb : callbacks) cb();
    lock.lock();
  }
}

void RdmaBackend::stop_resolver(Link& link) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    link.stop_resolver = true;
  }
  link.resolve_cv.notify_all();
  if (link.resolver.joinable()) link.resolver.join();
}

void RdmaBackend::pump(Link& link, Endpoint& ep, std::vector<Callback>& callbacks) {
  if (!ep.broken.empty() || !link.dead.empty()) return;
  const size_t room = kSendDepth - ep.posted.size();
  if (room == 0 || ep.pending.empty()) return;
  std::vector<ibv_send_wr> wrs;
  std::vector<ibv_sge> sges;
  wrs.reserve(room);
  sges.reserve(room);
  while (wrs.size() < room && !ep.pending.empty()) {
    if (rate_limited_ && credit_ < ep.pending.front().length) break;  // the pacer grants more soon
    WriteChunk c = std::move(ep.pending.front());
    ep.pending.pop_front();
    if (c.transfer->finished()) continue;  // cancelled or failed meanwhile
    if (rate_limited_) credit_ -= c.length;
    auto local = regions_.find(c.src->id);
    auto remote = link.remote_regions.find(c.dst_region);
    if (local == regions_.end() || remote == link.remote_regions.end()) {
      TransferPtr t = c.transfer;
      callbacks.push_back([this, t] { host_.transfer_failed(t, "RDMA source or destination region was unregistered"); });
      continue;
    }
    const bool last_of_transfer = ep.pending.empty() || ep.pending.front().transfer != c.transfer;
    const bool with_imm = last_of_transfer || ep.bytes_since_imm + c.length > kMaxImmBytes;
    const bool last_slot = wrs.size() + 1 == room;
    const bool signaled = with_imm || ++ep.since_signal >= kSignalEvery || last_slot;
    if (signaled) ep.since_signal = 0;

    sges.push_back({reinterpret_cast<uint64_t>(c.src->base + c.src_offset), c.length, local->second.mr->lkey});
    ibv_send_wr wr{};
    wr.wr_id = ep.next_seq;
    wr.sg_list = &sges.back();
    wr.num_sge = 1;
    wr.opcode = with_imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    wr.send_flags = signaled ? IBV_SEND_SIGNALED : 0;
    wr.wr.rdma.remote_addr = remote->second.address + c.dst_offset;
    wr.wr.rdma.rkey = remote->second.rkey;
    if (with_imm) {
      wr.imm_data = htonl(static_cast<uint32_t>(ep.bytes_since_imm + c.length));
      ep.bytes_since_imm = 0;
    } else {
      ep.bytes_since_imm += c.length;
    }
    wrs.push_back(wr);
    ep.tail_signaled = signaled;
    ep.tail_remote_addr = wr.wr.rdma.remote_addr;
    ep.tail_rkey = wr.wr.rdma.rkey;
    ep.posted.push_back({ep.next_seq++, std::move(c)});
  }
  if (wrs.empty()) return;
  for (size_t i = 0; i + 1 < wrs.size(); ++i) wrs[i].next = &wrs[i + 1];
  ibv_send_wr* bad = nullptr;
  const int rc = device_->verbs().post_send(ep.qp->qp(), wrs.data(), &bad);
  if (rc == 0) return;
  // The WRs from `bad` on were not posted: fail their transfers and retire the QP.
  ep.broken = std::string("ibv_post_send failed: ") + std::strerror(rc);
  const size_t first_bad = bad == nullptr ? 0 : static_cast<size_t>(bad - wrs.data());
  const size_t unposted = wrs.size() - first_bad;
  for (size_t i = 0; i < unposted; ++i) {
    TransferPtr t = ep.posted.back().chunk.transfer;
    ep.posted.pop_back();
    callbacks.push_back([this, t, why = ep.broken] { host_.transfer_failed(t, why); });
  }
}

int RdmaBackend::poll_sender(Link& link, Endpoint& ep, std::vector<Callback>& callbacks) {
  ibv_wc wc[32];
  const int n = device_->verbs().poll_cq(ep.qp->cq(), 32, wc);
  if (n < 0) {
    if (ep.broken.empty()) ep.broken = "ibv_poll_cq failed (completion queue overrun)";
    return 0;
  }
  std::deque<WriteChunk> resend;
  for (int i = 0; i < n; ++i) {
    // WRs before the completed one finished successfully (RC completes in order).
    while (!ep.posted.empty() && ep.posted.front().seq < wc[i].wr_id) {
      if (ep.posted.front().chunk.transfer)
        callbacks.push_back([this, c = std::move(ep.posted.front().chunk)] { host_.chunk_applied(c); });
      ep.posted.pop_front();
    }
    if (ep.posted.empty() || ep.posted.front().seq != wc[i].wr_id) continue;
    WriteChunk c = std::move(ep.posted.front().chunk);
    ep.posted.pop_front();
    if (!c.transfer) {  // a seal (see seal_locked)
      if (wc[i].status != IBV_WC_SUCCESS && wc[i].status != IBV_WC_WR_FLUSH_ERR && ep.broken.empty())
        ep.broken = std::string("RDMA write to ") + link.peer.address + " failed: " +
                    device_->verbs().wc_status_str(wc[i].status);
      else if (wc[i].status == IBV_WC_WR_FLUSH_ERR && ep.broken.empty())
        ep.broken = "RDMA QP to " + link.peer.address + " entered the error state";
      continue;
    }
    if (wc[i].status == IBV_WC_SUCCESS) {
      callbacks.push_back([this, c = std::move(c)] { host_.chunk_applied(c); });
      continue;
    }
    const std::string status = device_->verbs().wc_status_str(wc[i].status);
    if (wc[i].status != IBV_WC_WR_FLUSH_ERR) {
      ep.broken = "RDMA write to " + link.peer.address + " failed: " + status + " (wc status " +
                  std::to_string(wc[i].status) + ", vendor error " + std::to_string(wc[i].vendor_err) + ")";
      TransferPtr t = c.transfer;
      callbacks.push_back([this, t, why = ep.broken + " (" + describe(c) + ")"] { host_.transfer_failed(t, why); });
      continue;
    }
    // Flushed behind an earlier error (or a QP torn down): sent again on a repaired QP,
    // within the retry budget.
    if (ep.broken.empty()) ep.broken = "RDMA QP to " + link.peer.address + " entered the error state";
    if (c.transfer->finished()) continue;
    if (++c.attempts > host_.options().max_retries) {
      TransferPtr t = c.transfer;
      callbacks.push_back([this, t, why = "chunk (" + describe(c) + ") not delivered after " +
                                          std::to_string(c.attempts) + " attempts: " + ep.broken] {
        host_.transfer_failed(t, why);
      });
      continue;
    }
    callbacks.push_back([this, c] { host_.chunk_retried(c, "RDMA work request flushed"); });
    add_demand(c.length);
    resend.push_back(std::move(c));
  }
  ep.pending.insert(ep.pending.begin(), std::make_move_iterator(resend.begin()), std::make_move_iterator(resend.end()));
  return n;
}

void RdmaBackend::fail_link_locked(Link& link, const std::string& why, std::vector<Callback>& callbacks) {
  link.dead = why;
  std::set<const TransferState*> failed;
  for (auto& ep : link.endpoints) {
    for (WriteChunk& c : ep->pending)
      if (failed.insert(c.transfer.get()).second) {
        TransferPtr t = c.transfer;
        callbacks.push_back([this, t, why] { host_.transfer_failed(t, why); });
      }
    ep->pending.clear();
  }
}

void RdmaBackend::repair(const LinkPtr& link) {
  std::vector<std::unique_ptr<Endpoint>> broken;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = link->endpoints.begin(); it != link->endpoints.end();) {
      if (!(*it)->broken.empty() && (*it)->posted.empty()) {
        broken.push_back(std::move(*it));
        it = link->endpoints.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::vector<Callback> callbacks;
  try {
    auto fresh = open_endpoints(*link, static_cast<uint32_t>(broken.size()));
    std::string retire(4 + 4 * broken.size(), '\0');
    wire::Writer w(reinterpret_cast<uint8_t*>(retire.data()));
    w.put(static_cast<uint32_t>(broken.size()));
    for (auto& ep : broken) w.put(ep->remote_qpn);
    {
      std::lock_guard<std::mutex> setup_lock(link->setup_mutex);
      send_setup(link->setup, setup::Type::kQpRetire, retire);
    }
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t i = 0; i < broken.size(); ++i) {
      fresh[i]->pending = std::move(broken[i]->pending);
      pump(*link, *fresh[i], callbacks);
      link->endpoints.push_back(std::move(fresh[i]));
    }
    link->repairing = false;
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& ep : broken) link->endpoints.push_back(std::move(ep));  // their pending chunks fail below
    fail_link_locked(*link, "RDMA connection to " + link->peer.address + " lost (" + e.what() + ")", callbacks);
    link->repairing = false;
  }
  for (auto& cb : callbacks) cb();
}

void RdmaBackend::purge(const TransferState& transfer) {
  // Queued chunks go now. Posted ones stay until their completion: the NIC may still be
  // reading their source memory.
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = links_.find(transfer.peer_key);
  if (it == links_.end()) return;
  for (auto& ep : it->second->endpoints) {
    auto first = std::remove_if(ep->pending.begin(), ep->pending.end(),
                                [&](const WriteChunk& c) { return c.transfer.get() == &transfer; });
    for (auto c = first; c != ep->pending.end(); ++c) demand_ -= std::min<uint64_t>(demand_, c->length);
    ep->pending.erase(first, ep->pending.end());
    if (ep->pending.empty()) seal_locked(*ep);
  }
}

void RdmaBackend::drain(const transfer::TransferState& transfer, int64_t deadline_ns) {
  // Posted WRs cannot be recalled: once every one of the transfer's has retired (completed
  // or flushed), nothing more of it reaches the peer. The progress thread retires them.
  for (;;) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = links_.find(transfer.peer_key);
      bool outstanding = false;
      if (it != links_.end())
        for (auto& ep : it->second->endpoints)
          for (const Posted& p : ep->posted) outstanding = outstanding || p.chunk.transfer.get() == &transfer;
      if (!outstanding || closed_ || transfer::now_ns() > deadline_ns) return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void RdmaBackend::seal_locked(Endpoint& ep) {
  if (ep.tail_signaled || ep.posted.empty() || !ep.broken.empty()) return;
  ibv_send_wr wr{};
  wr.wr_id = ep.next_seq;
  wr.num_sge = 0;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = ep.tail_remote_addr;
  wr.wr.rdma.rkey = ep.tail_rkey;
  ibv_send_wr* bad = nullptr;
  if (int rc = device_->verbs().post_send(ep.qp->qp(), &wr, &bad); rc != 0) {
    ep.broken = std::string("ibv_post_send failed: ") + std::strerror(rc);
    return;
  }
  ep.posted.push_back({ep.next_seq++, WriteChunk{}});
  ep.tail_signaled = true;
}

// ---- pacing ------------------------------------------------------------------

void RdmaBackend::add_demand(uint64_t bytes) {
  if (!rate_limited_ || bytes == 0) return;
  demand_ += bytes;
  pacer_cv_.notify_one();
}

void RdmaBackend::pacer_loop() {
  // Buys send credit from the engine's rate limiter for queued bytes; pump() spends it.
  const uint64_t step = host_.options().chunk_bytes;
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    pacer_cv_.wait(lock, [this] { return stopping_ || demand_ > 0; });
    if (stopping_) break;
    const uint64_t n = std::min<uint64_t>(demand_, step);
    lock.unlock();
    host_.pace(n);
    lock.lock();
    demand_ -= std::min<uint64_t>(demand_, n);
    credit_ += n;
  }
}

// ---- target ------------------------------------------------------------------

int RdmaBackend::poll_target(Target& target, std::vector<Callback>& callbacks) {
  int total = 0;
  for (auto& qp : target.qps) {
    ibv_wc wc[32];
    const int n = device_->verbs().poll_cq(qp->cq(), 32, wc);
    for (int i = 0; i < n; ++i) {
      if (wc[i].status != IBV_WC_SUCCESS || wc[i].opcode != IBV_WC_RECV_RDMA_WITH_IMM) continue;  // flushed
      const uint64_t bytes = ntohl(wc[i].imm_data);
      callbacks.push_back([this, bytes] { host_.chunk_received(bytes, wire::AckStatus::kOk); });
      try {
        qp->post_receives(1);
      } catch (const std::exception&) {
        // The QP failed; the sender repairs it and retires this one.
      }
    }
    total += std::max(n, 0);
  }
  return total;
}

void RdmaBackend::serve(const Socket& socket, const PeerInfo&) {
  Target target{&socket, {}};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    targets_.push_back(&target);
  }
  socket.set_timeouts(0, host_.options().timeout_s);
  try {
    for (;;) {
      auto [type, payload] = recv_setup(socket);
      if (type == setup::Type::kQpRequest) {
        const std::vector<setup::QpAttributes> remote = setup::decode_qps(payload);
        size_t held;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          held = target.qps.size();
        }
        if (remote.empty() || held + remote.size() > kMaxTargetQps) {
          send_setup(socket, setup::Type::kError, remote.empty() ? "malformed QP request" : "too many QPs");
          continue;
        }
        std::vector<std::unique_ptr<QueuePair>> qps;
        std::vector<setup::QpAttributes> local;
        try {
          for (const auto& r : remote) {
            auto qp = std::make_unique<QueuePair>(*device_, 1, kRecvDepth);
            qp->connect(r, host_.options().timeout_s, /*sends=*/false);
            qp->post_receives(kRecvDepth);
            local.push_back(qp->local());
            qps.push_back(std::move(qp));
          }
        } catch (const std::exception& e) {
          send_setup(socket, setup::Type::kError, e.what());
          continue;
        }
        {
          std::lock_guard<std::mutex> lock(mutex_);
          for (auto& qp : qps) target.qps.push_back(std::move(qp));
        }
        send_setup(socket, setup::Type::kQpReply, setup::encode_qps(local));
      } else if (type == setup::Type::kQpRetire && payload.size() >= 4) {
        wire::Reader r(reinterpret_cast<const uint8_t*>(payload.data()));
        const uint32_t n = std::min<uint32_t>(r.get<uint32_t>(), static_cast<uint32_t>((payload.size() - 4) / 4));
        std::set<uint32_t> qpns;
        for (uint32_t i = 0; i < n; ++i) qpns.insert(r.get<uint32_t>());
        std::vector<std::unique_ptr<QueuePair>> retired;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          for (auto it = target.qps.begin(); it != target.qps.end();) {
            if (qpns.count((*it)->qp()->qp_num)) {
              retired.push_back(std::move(*it));
              it = target.qps.erase(it);
            } else {
              ++it;
            }
          }
        }
      } else if (type == setup::Type::kRegionQuery && payload.size() == setup::RegionQuery::kSize) {
        setup::RegionQuery query;
        query.decode(reinterpret_cast<const uint8_t*>(payload.data()));
        setup::RegionKey key;
        key.region_id = query.region_id;
        {
          std::lock_guard<std::mutex> lock(mutex_);
          if (auto it = regions_.find(key.region_id); it != regions_.end() && !it->second.target) {
            key.status = wire::AckStatus::kNotATarget;  // no rkey for a source
          } else if (it != regions_.end()) {
            key.address = reinterpret_cast<uint64_t>(it->second.mr->addr);
            key.rkey = it->second.mr->rkey;
            key.size = it->second.mr->length;
            key.status = key.contains(query.offset, query.length) ? wire::AckStatus::kOk : wire::AckStatus::kOutOfBounds;
          }
        }
        // The target checks the first write into a region, as a TCP receiver checks chunks;
        // later writes are checked by the sender against this table, and by the NIC.
        if (key.status != wire::AckStatus::kOk) host_.chunk_received(0, key.status);
        std::string reply(setup::RegionKey::kSize, '\0');
        key.encode(reinterpret_cast<uint8_t*>(reply.data()));
        send_setup(socket, setup::Type::kRegionReply, reply);
      } else {
        break;  // a peer that speaks something else: close the connection
      }
    }
  } catch (const std::exception&) {
    // The peer closed the setup connection (or the engine is closing).
  }
  // The QPs go before the target leaves targets_: close() waits for that, then frees the device.
  std::vector<std::unique_ptr<QueuePair>> qps;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    qps.swap(target.qps);
  }
  qps.clear();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    targets_.erase(std::find(targets_.begin(), targets_.end(), &target));
  }
  targets_cv_.notify_all();
}

// ---- progress and teardown ---------------------------------------------------

void RdmaBackend::progress_loop() {
  int idle_rounds = 0;
  while (!stopping_) {
    std::vector<Callback> callbacks;
    std::vector<LinkPtr> to_repair;
    int seen = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [key, link] : links_) {
        bool needs_repair = false;
        for (auto& ep : link->endpoints) {
          seen += poll_sender(*link, *ep, callbacks);
          pump(*link, *ep, callbacks);
          needs_repair = needs_repair || (!ep->broken.empty() && ep->posted.empty());
        }
        if (needs_repair && link->dead.empty() && !link->repairing) {
          link->repairing = true;
          to_repair.push_back(link);
        }
      }
      for (Target* t : targets_) seen += poll_target(*t, callbacks);
    }
    for (auto& cb : callbacks) cb();
    for (auto& link : to_repair) repair(link);
    // Busy polling costs a core; back off to 1 ms while nothing completes.
    idle_rounds = seen > 0 ? 0 : std::min(idle_rounds + 1, 7);
    if (seen == 0) std::this_thread::sleep_for(std::chrono::microseconds(8 << idle_rounds));
  }
}

void RdmaBackend::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (closed_) return;
    closed_ = true;
    for (auto& [key, link] : links_) link->setup.shutdown();
    for (Target* t : targets_) t->socket->shutdown();
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  pacer_cv_.notify_all();
  if (progress_.joinable()) progress_.join();
  if (pacer_.joinable()) pacer_.join();
  for (auto& [key, link] : links_) stop_resolver(*link);  // links_ no longer changes: closed_
  {
    std::unique_lock<std::mutex> lock(mutex_);
    targets_cv_.wait(lock, [this] { return targets_.empty(); });
    for (auto& [key, link] : links_) {
      link->dead = "engine is closed";
      link->endpoints.clear();  // destroys the sender QPs and CQs
    }
    links_.clear();
  }
  for (auto& [id, region] : regions_) device_->verbs().dereg_mr(region.mr);
  regions_.clear();
  device_.reset();
}

void RdmaBackend::debug_kill_stream(uint64_t peer_key, uint32_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = links_.find(peer_key);
  if (it == links_.end() || it->second->endpoints.empty()) return;
  ibv_qp_attr attr{};
  attr.qp_state = IBV_QPS_ERR;
  auto& eps = it->second->endpoints;
  device_->verbs().modify_qp(eps[stream % eps.size()]->qp->qp(), &attr, IBV_QP_STATE);
}

void RdmaBackend::debug_corrupt_chunks(uint32_t) {
  // The NIC moves the bytes and the link's ICRC checks them: there is no pddcore CRC to defeat.
  throw std::invalid_argument("debug_corrupt_chunks does not apply to the rdma backend: its payloads are checked by "
                              "the fabric (link CRC), not by a pddcore CRC32C");
}

}  // namespace pddcore::rdma
