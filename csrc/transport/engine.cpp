#include "engine.h"

#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "device_memory.h"

namespace pddcore::transfer {

namespace {

constexpr int64_t kPingIntervalNs = 1'000'000'000;
constexpr auto kWatchdogTick = std::chrono::milliseconds(50);

std::string encode_i64(int64_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }

}  // namespace

Engine::Engine(EngineOptions options) : options_(std::move(options)) {
  if (options_.streams == 0 || options_.streams > 64) throw std::invalid_argument("streams must be in [1, 64]");
  if (options_.chunk_bytes == 0 || options_.chunk_bytes > wire::kMaxChunkBytes)
    throw std::invalid_argument("chunk_bytes must be in [1, " + std::to_string(wire::kMaxChunkBytes) + "]");
  if (!(options_.timeout_s > 0)) throw std::invalid_argument("timeout_s must be positive");
  if (options_.rate_limit_bps < 0) throw std::invalid_argument("rate_limit_bps must be positive or 0 (unlimited)");
  if (options_.queue_delay_target_s < 0) throw std::invalid_argument("queue_delay_target_s must be positive or 0 (off)");
  if (options_.max_connections == 0 || options_.max_connections_per_host == 0 || options_.max_inbox_bytes == 0 ||
      !(options_.idle_timeout_s > 0))
    throw std::invalid_argument(
        "max_connections, max_connections_per_host, max_inbox_bytes and idle_timeout_s must be positive");
  if (options_.tls && !options_.has_token) throw std::invalid_argument("tls needs an auth_token (its key comes from it)");
  if (options_.tls) tls_ = std::make_unique<TlsContext>(options_.auth_token);
  uint16_t port = 0;
  listener_ = listen_tcp({options_.listen_host, options_.listen_port}, &port);
  address_ = format_address({options_.listen_host, port});
  random_bytes(&handshake_.engine_id, sizeof(handshake_.engine_id));
  handshake_.address = address_;
  handshake_.has_token = options_.has_token;
  handshake_.token = options_.auth_token;
  handshake_.timeout_s = options_.timeout_s;
  backends_ = make_backends(*this);
  backend_ = backends_.front().get();
  accept_thread_ = std::thread([this] { accept_loop(); });
  watchdog_thread_ = std::thread([this] { watchdog_loop(); });
}

Engine::~Engine() { close(); }

const char* Engine::backend_name() const { return backend_->name(); }

void Engine::close() {
  std::lock_guard<std::mutex> close_guard(close_mutex_);
  if (closed_) return;
  closed_ = true;
  {
    std::lock_guard<std::mutex> lock(pace_mutex_);
    closing_ = true;
  }
  wake_.notify_all();
  {
    std::lock_guard<std::mutex> lock(inbox_mutex_);  // so inbox waiters see closing_
  }
  inbox_cv_.notify_all();
  inbox_space_cv_.notify_all();
  watchdog_thread_.join();
  listener_.shutdown();
  accept_thread_.join();
  for (auto& backend : backends_) backend->close();
  {
    std::lock_guard<std::mutex> lock(connections_mutex_);
    for (auto& conn : connections_) conn->socket.shutdown();
  }
  for (auto& conn : connections_) conn->thread.join();
  connections_.clear();
  std::map<uint64_t, PeerPtr> peers;
  {
    std::lock_guard<std::mutex> lock(peers_mutex_);
    peers.swap(peers_);
  }
  for (auto& [key, peer] : peers) {
    peer->alive = false;
    peer->control.shutdown();
    peer->reader.join();
  }
  std::vector<TransferPtr> pending;
  {
    std::lock_guard<std::mutex> lock(transfers_mutex_);
    for (auto& [id, active] : active_) pending.push_back(active.transfer);
  }
  for (auto& t : pending) finish_transfer(t, TransferStatus::kFailed, "engine closed");
}

// ---- regions ---------------------------------------------------------------

uint64_t Engine::register_memory(uintptr_t base, uint64_t size, bool target, bool listed_address) {
  if (listed_address && !target) throw std::invalid_argument("only a write target is listed, with or without address");
  if (closing_) throw TransferError("engine is closed");
  if (base == 0 || size == 0) throw std::invalid_argument("cannot register an empty or null memory range");
  const bool on_device = is_device_memory(reinterpret_cast<const void*>(base));
  if (on_device && std::string(backend_->name()) == "tcp")
    throw std::invalid_argument("address " + std::to_string(base) +
                                " is GPU memory: the tcp backend reads and writes registered memory with the CPU; "
                                "register pinned host memory (pddcore.integrations StagingPool does) or use the rdma "
                                "backend with GPUDirect");
  std::lock_guard<std::mutex> lock(regions_mutex_);
  auto region =
      std::make_shared<const Region>(Region{next_region_id_++, reinterpret_cast<uint8_t*>(base), size, on_device, target,
                                            listed_address});
  for (auto& backend : backends_) backend->register_memory(region);
  regions_.emplace(region->id, region);
  return region->id;
}

void Engine::unregister_memory(uint64_t region_id) {
  {
    std::lock_guard<std::mutex> lock(transfers_mutex_);
    for (const auto& [id, active] : active_)
      if (std::count(active.source_regions.begin(), active.source_regions.end(), region_id))
        throw TransferError("region " + std::to_string(region_id) +
                            " is the source of an active transfer; wait for it or cancel it first");
  }
  RegionPtr region;
  {
    std::lock_guard<std::mutex> lock(regions_mutex_);
    auto it = regions_.find(region_id);
    if (it == regions_.end()) throw std::invalid_argument("region " + std::to_string(region_id) + " is not registered");
    region = std::move(it->second);
    regions_.erase(it);
    for (auto& backend : backends_) backend->deregister_memory(region_id);
  }
  // Chunks being sent from or received into the region hold a reference; they finish
  // within a socket deadline.
  const int64_t deadline = now_ns() + static_cast<int64_t>(options_.timeout_s * 1e9);
  while (region.use_count() > 1) {
    if (now_ns() > deadline)
      throw TransferError("region " + std::to_string(region_id) + " still in use by a chunk after timeout_s");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

RegionPtr Engine::find_region(uint64_t region_id) {
  std::lock_guard<std::mutex> lock(regions_mutex_);
  auto it = regions_.find(region_id);
  return it == regions_.end() ? nullptr : it->second;
}

// ---- connections -----------------------------------------------------------

Socket Engine::dial(const PeerInfo& peer, wire::ConnKind kind, uint8_t stream) {
  if (closing_) throw TransferError("engine is closed");
  Socket s = dial_tcp(parse_address(peer.address), options_.timeout_s);
  if (tls_) tls_->secure_client(s, options_.timeout_s);
  const uint64_t id = dial_handshake(s, handshake_, kind, stream);
  if (id != peer.engine_id) throw TransferError("engine at " + peer.address + " was replaced (its engine id changed)");
  return s;
}

PeerPtr Engine::connect(const std::string& address, const std::string& backend) {
  if (closing_) throw TransferError("engine is closed");
  auto peer = std::make_shared<Peer>();
  for (auto& b : backends_)
    if (backend.empty() ? b.get() == backend_ : backend == b->name()) peer->backend = b.get();
  if (peer->backend == nullptr) {
    std::string names;
    for (auto& b : backends_) names += std::string(names.empty() ? "" : ", ") + b->name();
    throw std::invalid_argument("backend '" + backend + "' is not available on this engine (it has: " + names + ")");
  }
  peer->info.address = address;
  peer->control = dial_tcp(parse_address(address), options_.timeout_s);
  if (tls_) tls_->secure_client(peer->control, options_.timeout_s);
  peer->info.engine_id = dial_handshake(peer->control, handshake_, wire::ConnKind::kControl, 0);
  peer->control.set_timeouts(0, options_.timeout_s);
  peer->control.set_nodelay();
  {
    std::lock_guard<std::mutex> lock(peers_mutex_);
    if (closing_) throw TransferError("engine is closed");
    peer->info.key = next_peer_key_++;
    peers_.emplace(peer->info.key, peer);
  }
  peer->reader = std::thread([this, peer] { read_control_replies(peer); });
  try {
    peer->backend->connect(peer->info);
  } catch (...) {
    disconnect(peer);
    throw;
  }
  send_control(*peer, wire::ControlType::kPing, encode_i64(now_ns()));
  return peer;
}

void Engine::disconnect(const PeerPtr& peer) {
  {
    std::lock_guard<std::mutex> lock(peers_mutex_);
    if (peers_.erase(peer->info.key) == 0) return;
  }
  peer->backend->disconnect(peer->info.key);
  {
    std::lock_guard<std::mutex> lock(peer->send_mutex);
    peer->alive = false;
    peer->lost_reason = "disconnected";
    peer->control.shutdown();
  }
  peer->reader.join();
  std::vector<TransferPtr> pending;
  {
    std::lock_guard<std::mutex> lock(transfers_mutex_);
    for (auto& [id, active] : active_)
      if (active.peer == peer) pending.push_back(active.transfer);
  }
  for (auto& t : pending) finish_transfer(t, TransferStatus::kFailed, "peer disconnected");
}

void Engine::accept_loop() {
  while (!closing_) {
    pollfd pfd{listener_.fd(), POLLIN, 0};
    if (::poll(&pfd, 1, 200) <= 0) continue;
    const int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    try {
      admit(Socket(fd));
    } catch (const std::exception&) {
      ++connections_refused_;  // e.g. no thread could be started: that connection is closed, the engine goes on
    }
  }
}

void Engine::admit(Socket socket) {
  const std::string host = peer_ip(socket);
  std::lock_guard<std::mutex> lock(connections_mutex_);
  size_t from_host = 0;
  for (auto it = connections_.begin(); it != connections_.end();) {
    if ((*it)->done) {
      (*it)->thread.join();
      it = connections_.erase(it);
    } else {
      from_host += (*it)->host == host;
      ++it;
    }
  }
  if (connections_.size() >= options_.max_connections || from_host >= options_.max_connections_per_host) {
    ++connections_refused_;
    return;  // the socket closes here
  }
  auto conn = std::make_unique<Connection>();
  conn->socket = std::move(socket);
  conn->host = host;
  Connection* raw = conn.get();
  conn->thread = std::thread([this, raw] { serve_connection(raw); });
  connections_.push_back(std::move(conn));
}

void Engine::serve_connection(Connection* conn) {
  try {
    if (tls_) tls_->secure_server(conn->socket, options_.timeout_s);
    const ClientHello hello = accept_handshake(conn->socket, handshake_);
    // A client listening on a wildcard address is reachable at the address it came from.
    HostPort from = parse_address(hello.address);
    if (from.host == "0.0.0.0") from.host = peer_ip(conn->socket);
    const std::string from_address = format_address(from);
    conn->socket.set_nodelay();
    if (hello.kind == wire::ConnKind::kControl) serve_control(conn->socket, from_address, hello.engine_id);
    for (auto& backend : backends_)  // a kind no backend serves (e.g. RDMA to a tcp-only engine) is closed
      if (hello.kind == backend->conn_kind()) backend->serve(conn->socket, PeerInfo{0, from_address, hello.engine_id});
  } catch (const TlsError&) {
    ++tls_errors_;  // a failed TLS handshake, or a record that failed its authentication
  } catch (const std::exception&) {
    // A refused, broken or malformed connection affects only itself.
  }
  conn->socket.shutdown();
  conn->done = true;
}

void Engine::serve_control(const Socket& s, const std::string& from, uint64_t from_engine_id) {
  std::vector<uint8_t> payload;
  while (!closing_) {
    uint8_t header_bytes[wire::ControlHeader::kSize];
    if (!s.recv_frame(header_bytes, sizeof(header_bytes))) continue;
    wire::ControlHeader header;
    if (!header.decode(header_bytes)) throw TransferError("malformed control frame");
    payload.resize(header.length);
    s.recv_all(payload.data(), payload.size());
    if (crc32c(payload.data(), payload.size()) != header.crc) throw TransferError("control frame CRC mismatch");
    std::string body(payload.begin(), payload.end());
    wire::ControlHeader reply;
    std::string reply_body;
    switch (header.type) {
      case wire::ControlType::kMessage:
      case wire::ControlType::kNotify: {
        {
          std::unique_lock<std::mutex> lock(inbox_mutex_);
          // Back-pressure: a flooding peer waits here; one message always fits an empty inbox.
          inbox_space_cv_.wait(lock, [&] {
            return closing_ || inbox_.empty() || inbox_bytes_ + body.size() <= options_.max_inbox_bytes;
          });
          if (closing_) return;
          inbox_bytes_ += body.size();
          inbox_.push_back({from, from_engine_id, std::move(body), header.type == wire::ControlType::kNotify});
          ++messages_received_;
        }
        inbox_cv_.notify_all();
        continue;
      }
      case wire::ControlType::kPing:
        reply.type = wire::ControlType::kPong;
        reply_body = std::move(body);
        break;
      case wire::ControlType::kFence: {
        if (body.size() != sizeof(uint32_t)) throw TransferError("malformed fence");
        install_fence(from_engine_id, wire::Reader(reinterpret_cast<const uint8_t*>(body.data())).get<uint32_t>());
        reply.type = wire::ControlType::kFenceAck;
        reply_body = std::move(body);
        break;
      }
      case wire::ControlType::kRegionQuery: {
        reply.type = wire::ControlType::kRegionList;
        std::lock_guard<std::mutex> lock(regions_mutex_);
        for (const auto& [id, region] : regions_) {
          if (!region->target) continue;
          uint8_t entry[wire::RegionEntry::kSize];
          const uint64_t address = region->listed_address ? reinterpret_cast<uint64_t>(region->base) : 0;
          wire::Writer(entry).put(id).put(address).put(region->size);
          reply_body.append(reinterpret_cast<const char*>(entry), sizeof(entry));
        }
        break;
      }
      default:
        throw TransferError("unexpected control frame");
    }
    reply.length = static_cast<uint32_t>(reply_body.size());
    reply.crc = crc32c(reply_body.data(), reply_body.size());
    uint8_t reply_header[wire::ControlHeader::kSize];
    reply.encode(reply_header);
    iovec iov[2] = {{reply_header, sizeof(reply_header)}, {reply_body.data(), reply_body.size()}};
    s.sendv_all(iov, 2);
  }
}

void Engine::read_control_replies(const PeerPtr& peer) {
  std::string why = "engine closed";
  try {
    std::vector<uint8_t> payload;
    for (;;) {
      uint8_t header_bytes[wire::ControlHeader::kSize];
      peer->control.recv_all(header_bytes, sizeof(header_bytes));
      wire::ControlHeader header;
      if (!header.decode(header_bytes)) throw TransferError("malformed control reply");
      payload.resize(header.length);
      peer->control.recv_all(payload.data(), payload.size());
      if (crc32c(payload.data(), payload.size()) != header.crc) throw TransferError("control reply CRC mismatch");
      if (header.type == wire::ControlType::kPong && payload.size() == sizeof(int64_t)) {
        int64_t sent;
        std::memcpy(&sent, payload.data(), sizeof(sent));
        const int64_t sample = now_ns() - sent, old = peer->rtt_ns.load();
        peer->rtt_ns = old == 0 ? sample : (old * 7 + sample) / 8;
      } else if (header.type == wire::ControlType::kRegionList) {
        std::lock_guard<std::mutex> lock(peer->reply_mutex);
        peer->region_list.clear();
        wire::Reader r(payload.data());
        for (size_t i = 0; i < payload.size() / wire::RegionEntry::kSize; ++i) {
          wire::RegionEntry e;
          e.region_id = r.get<uint64_t>();
          e.base_address = r.get<uint64_t>();
          e.size = r.get<uint64_t>();
          peer->region_list.push_back(e);
        }
        ++peer->region_lists_received;
        peer->reply_cv.notify_all();
      } else if (header.type == wire::ControlType::kFenceAck && payload.size() == sizeof(uint32_t)) {
        std::lock_guard<std::mutex> lock(peer->reply_mutex);
        peer->fences_confirmed.insert(wire::Reader(payload.data()).get<uint32_t>());
        peer->reply_cv.notify_all();
      }
    }
  } catch (const std::exception& e) {
    if (!closing_) why = e.what();
  }
  {
    std::lock_guard<std::mutex> lock(peer->send_mutex);
    peer->alive = false;
    peer->lost_reason = why;
  }
  peer->reply_cv.notify_all();
}

void Engine::send_control(Peer& peer, wire::ControlType type, const std::string& payload) {
  if (payload.size() > wire::kMaxControlBytes)
    throw std::invalid_argument("control payload of " + std::to_string(payload.size()) + " bytes exceeds the " +
                                std::to_string(wire::kMaxControlBytes) + "-byte limit");
  wire::ControlHeader header;
  header.type = type;
  header.length = static_cast<uint32_t>(payload.size());
  header.crc = crc32c(payload.data(), payload.size());
  uint8_t header_bytes[wire::ControlHeader::kSize];
  header.encode(header_bytes);
  iovec iov[2] = {{header_bytes, sizeof(header_bytes)}, {const_cast<char*>(payload.data()), payload.size()}};
  std::lock_guard<std::mutex> lock(peer.send_mutex);
  if (!peer.alive) throw TransferError("control connection to " + peer.info.address + " lost: " + peer.lost_reason);
  try {
    peer.control.sendv_all(iov, 2);
  } catch (const TransferError& e) {
    peer.alive = false;
    peer.lost_reason = e.what();
    peer.control.shutdown();
    throw TransferError("control connection to " + peer.info.address + " lost: " + e.what());
  }
}

void Engine::send(const PeerPtr& peer, const std::string& message) {
  send_control(*peer, wire::ControlType::kMessage, message);
  ++messages_sent_;
}

std::vector<InboxEntry> Engine::poll_messages(double timeout_s) {
  std::unique_lock<std::mutex> lock(inbox_mutex_);
  if (timeout_s > 0)
    inbox_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return !inbox_.empty() || closing_; });
  std::vector<InboxEntry> out(std::make_move_iterator(inbox_.begin()), std::make_move_iterator(inbox_.end()));
  inbox_.clear();
  inbox_bytes_ = 0;
  lock.unlock();
  inbox_space_cv_.notify_all();
  return out;
}

std::vector<wire::RegionEntry> Engine::remote_regions(const PeerPtr& peer) {
  uint64_t seen;
  {
    std::lock_guard<std::mutex> lock(peer->reply_mutex);
    seen = peer->region_lists_received;
  }
  send_control(*peer, wire::ControlType::kRegionQuery, {});
  std::unique_lock<std::mutex> lock(peer->reply_mutex);
  const bool answered = peer->reply_cv.wait_for(lock, std::chrono::duration<double>(options_.timeout_s), [&] {
    return peer->region_lists_received > seen || !peer->alive;
  });
  if (peer->region_lists_received == seen)
    throw TransferError("peer " + peer->info.address + (answered ? " disconnected" : " did not answer") +
                        " a region query");
  return peer->region_list;
}

// ---- transfers -------------------------------------------------------------

TransferPtr Engine::write_batch(const PeerPtr& peer, const std::vector<WriteOp>& ops,
                                std::optional<std::string> notify) {
  if (closing_) throw TransferError("engine is closed");
  if (ops.empty()) throw std::invalid_argument("write_batch needs at least one write");
  if (notify && notify->size() > wire::kMaxControlBytes) throw std::invalid_argument("notify payload too large");
  if (!peer->alive) throw TransferError("peer " + peer->info.address + " is disconnected: " + peer->lost_reason);
  std::vector<WriteChunk> chunks;
  std::vector<uint64_t> sources;
  uint64_t total = 0;
  for (const WriteOp& op : ops) {
    RegionPtr src = find_region(op.src_region);
    if (!src) throw std::invalid_argument("source region " + std::to_string(op.src_region) + " is not registered");
    if (op.nbytes == 0) throw std::invalid_argument("write of 0 bytes");
    if (op.src_offset > src->size || op.nbytes > src->size - op.src_offset)
      throw std::invalid_argument("source range [" + std::to_string(op.src_offset) + ", +" + std::to_string(op.nbytes) +
                                  ") is outside region " + std::to_string(src->id) + " of " +
                                  std::to_string(src->size) + " bytes");
    sources.push_back(src->id);
    for (uint64_t done = 0; done < op.nbytes;) {
      const uint32_t len = static_cast<uint32_t>(std::min<uint64_t>(options_.chunk_bytes, op.nbytes - done));
      WriteChunk c;
      c.src = src;
      c.src_offset = op.src_offset + done;
      c.dst_region = op.dst_region;
      c.dst_offset = op.dst_offset + done;
      c.length = len;
      c.index = static_cast<uint32_t>(chunks.size());
      chunks.push_back(std::move(c));
      done += len;
    }
    total += op.nbytes;
  }
  TransferPtr transfer;
  {
    std::lock_guard<std::mutex> lock(transfers_mutex_);
    transfer = std::make_shared<TransferState>(next_transfer_id_++, peer->info.key, total);
    active_.emplace(transfer->id,
                    ActiveTransfer{transfer, peer, std::move(notify), std::move(sources),
                                   std::vector<bool>(chunks.size(), false)});
  }
  {
    std::lock_guard<std::mutex> lock(peer->busy_mutex);
    if (peer->active_transfers++ == 0) peer->busy_since_ns = now_ns();
  }
  for (auto& c : chunks) c.transfer = transfer;
  peer->backend->post(peer->info.key, std::move(chunks));
  return transfer;
}

void Engine::chunk_applied(const WriteChunk& chunk) {
  const TransferPtr& t = chunk.transfer;
  std::optional<ActiveTransfer> completed;
  {
    std::lock_guard<std::mutex> lock(transfers_mutex_);
    auto it = active_.find(t->id);
    if (it == active_.end()) return;
    ActiveTransfer& active = it->second;
    // A chunk resent after a lost ack is applied twice but counted once.
    if (active.chunk_acked[chunk.index]) return;
    active.chunk_acked[chunk.index] = true;
    t->last_progress_ns = now_ns();
    active.peer->last_ack_ns = t->last_progress_ns.load();
    active.peer->bytes_sent += chunk.length;
    ++active.peer->chunks_sent;
    if (t->bytes_acked.fetch_add(chunk.length) + chunk.length == t->total_bytes) {
      // Leave no moved-from entry behind: the watchdog and close() walk active_.
      completed = std::move(active);
      active_.erase(it);
    }
  }
  bytes_sent_ += chunk.length;
  ++chunks_sent_;
  if (completed) complete_transfer(std::move(*completed));
}

void Engine::complete_transfer(ActiveTransfer active) {
  // The notification goes out only now: every chunk was verified and applied.
  if (active.notify) {
    try {
      send_control(*active.peer, wire::ControlType::kNotify, *active.notify);
    } catch (const std::exception& e) {
      finish_transfer(active.transfer, TransferStatus::kFailed,
                      std::string("data applied but the notification was not delivered: ") + e.what(), active.peer);
      return;
    }
  }
  finish_transfer(active.transfer, TransferStatus::kDone, {}, active.peer);
}

void Engine::chunk_retried(const WriteChunk& chunk, const std::string& why) {
  ++retries_;
  if (why == wire::to_string(wire::AckStatus::kBadCrc)) ++crc_errors_;
  if (PeerPtr peer = find_peer(chunk.transfer->peer_key)) ++peer->retries;
}

void Engine::transfer_failed(const TransferPtr& transfer, const std::string& why) {
  finish_transfer(transfer, TransferStatus::kFailed, why);
}

void Engine::cancel(const TransferPtr& transfer) {
  const PeerPtr peer = find_peer(transfer->peer_key);
  finish_transfer(transfer, TransferStatus::kCancelled, "cancelled");
  // A failed transfer is fenced too: its chunks on the wire must not land in a reused range.
  if (transfer->status() == TransferStatus::kDone || !peer) return;
  const int64_t deadline = now_ns() + static_cast<int64_t>(options_.timeout_s * 1e9);
  peer->backend->drain(*transfer, deadline);
  const uint32_t tag = static_cast<uint32_t>(transfer->id);
  std::string payload(sizeof(tag), '\0');
  wire::Writer(reinterpret_cast<uint8_t*>(payload.data())).put(tag);
  send_control(*peer, wire::ControlType::kFence, payload);
  std::unique_lock<std::mutex> lock(peer->reply_mutex);
  const bool confirmed = peer->reply_cv.wait_until(lock, std::chrono::steady_clock::now() +
                                                             std::chrono::nanoseconds(deadline - now_ns()),
                                                   [&] { return peer->fences_confirmed.count(tag) || !peer->alive; });
  if (!confirmed || !peer->fences_confirmed.erase(tag))
    throw TransferError("transfer cancelled, but " + peer->info.address +
                        " did not confirm that its chunks are fenced: bytes already sent may still land");
}

void Engine::install_fence(uint64_t sender_engine_id, uint32_t transfer_tag) {
  const FenceKey key{sender_engine_id, transfer_tag};
  std::unique_lock<std::mutex> lock(fence_mutex_);
  if (fenced_.insert(key).second) {
    fence_order_.push_back(key);
    if (fence_order_.size() > kMaxFences) {
      fenced_.erase(fence_order_.front());
      fence_order_.pop_front();
    }
  }
  fence_cv_.wait_for(lock, std::chrono::duration<double>(options_.timeout_s),
                     [&] { return closing_ || receiving_.count(key) == 0; });
}

bool Engine::begin_receive(uint64_t sender_engine_id, uint32_t transfer_tag) {
  const FenceKey key{sender_engine_id, transfer_tag};
  std::lock_guard<std::mutex> lock(fence_mutex_);
  if (fenced_.count(key)) return false;
  ++receiving_[key];
  return true;
}

void Engine::end_receive(uint64_t sender_engine_id, uint32_t transfer_tag) {
  {
    std::lock_guard<std::mutex> lock(fence_mutex_);
    auto it = receiving_.find({sender_engine_id, transfer_tag});
    if (it != receiving_.end() && --it->second == 0) receiving_.erase(it);
  }
  fence_cv_.notify_all();
}

void Engine::finish_transfer(const TransferPtr& transfer, TransferStatus status, const std::string& error,
                             PeerPtr peer) {
  {
    std::lock_guard<std::mutex> lock(transfers_mutex_);
    auto it = active_.find(transfer->id);
    if (it != active_.end()) {
      peer = it->second.peer;
      active_.erase(it);
    }
  }
  if (!peer) peer = find_peer(transfer->peer_key);  // a cancel or timeout that raced with the completion path
  if (!transfer->finish(status, error)) return;
  if (status != TransferStatus::kDone)
    for (auto& backend : backends_) backend->purge(*transfer);
  (status == TransferStatus::kDone ? transfers_done_
   : status == TransferStatus::kFailed ? transfers_failed_
                                        : transfers_cancelled_)++;
  if (!peer) return;
  (status == TransferStatus::kDone ? peer->transfers_done : peer->transfers_failed)++;
  std::lock_guard<std::mutex> lock(peer->busy_mutex);
  if (--peer->active_transfers == 0) peer->busy_total_ns += now_ns() - peer->busy_since_ns;
}

PeerPtr Engine::find_peer(uint64_t peer_key) const {
  std::lock_guard<std::mutex> lock(peers_mutex_);
  auto it = peers_.find(peer_key);
  return it == peers_.end() ? nullptr : it->second;
}

void Engine::pace(uint64_t bytes) {
  if (options_.rate_limit_bps <= 0) return;
  const double ns_per_byte = 8e9 / options_.rate_limit_bps;
  // Up to 10 ms of unused rate may be spent as a burst.
  const int64_t burst_ns = 10'000'000;
  std::unique_lock<std::mutex> lock(pace_mutex_);
  const int64_t now = now_ns();
  const int64_t start = std::max(pace_next_ns_, now - burst_ns);
  pace_next_ns_ = start + static_cast<int64_t>(static_cast<double>(bytes) * ns_per_byte);
  if (start > now)
    wake_.wait_for(lock, std::chrono::nanoseconds(start - now), [this] { return closing_.load(); });
}

void Engine::watchdog_loop() {
  const int64_t timeout_ns = static_cast<int64_t>(options_.timeout_s * 1e9);
  int64_t next_ping = now_ns() + kPingIntervalNs;
  std::unique_lock<std::mutex> lock(pace_mutex_);
  while (!wake_.wait_for(lock, kWatchdogTick, [this] { return closing_.load(); })) {
    lock.unlock();
    const int64_t now = now_ns();
    std::vector<std::pair<TransferPtr, std::string>> stalled;
    {
      std::lock_guard<std::mutex> guard(transfers_mutex_);
      // Transfers queued behind others to the same peer count the peer's acks as progress.
      for (const auto& [id, active] : active_)
        if (now - std::max<int64_t>(active.transfer->last_progress_ns, active.peer->last_ack_ns) > timeout_ns)
          stalled.emplace_back(active.transfer, active.peer->info.address);
    }
    for (auto& [t, address] : stalled)
      finish_transfer(t, TransferStatus::kFailed,
                      "no progress from peer " + address + " for " + std::to_string(options_.timeout_s) +
                          " s (timeout_s): peer dead or unreachable");
    if (now >= next_ping) {
      next_ping = now + kPingIntervalNs;
      std::vector<PeerPtr> peers;
      {
        std::lock_guard<std::mutex> guard(peers_mutex_);
        for (auto& [key, peer] : peers_)
          if (peer->alive) peers.push_back(peer);
      }
      for (auto& peer : peers) {
        try {
          send_control(*peer, wire::ControlType::kPing, encode_i64(now_ns()));
        } catch (const std::exception&) {
          // A lost control connection shows in the peer's stats and in its transfers.
        }
      }
    }
    lock.lock();
  }
}

void Engine::chunk_received(uint64_t bytes, wire::AckStatus status) {
  if (status == wire::AckStatus::kOk) {
    bytes_received_ += bytes;
    ++chunks_received_;
  } else {
    ++chunks_rejected_;
  }
}

// ---- stats and test hooks --------------------------------------------------

StatsMap Engine::totals() const {
  size_t active;
  {
    std::lock_guard<std::mutex> lock(transfers_mutex_);
    active = active_.size();
  }
  return {{"bytes_sent", double(bytes_sent_)},
          {"chunks_sent", double(chunks_sent_)},
          {"bytes_received", double(bytes_received_)},
          {"chunks_received", double(chunks_received_)},
          {"chunks_rejected", double(chunks_rejected_)},
          {"retries", double(retries_)},
          {"crc_errors", double(crc_errors_)},
          {"transfers_active", double(active)},
          {"transfers_done", double(transfers_done_)},
          {"transfers_failed", double(transfers_failed_)},
          {"transfers_cancelled", double(transfers_cancelled_)},
          {"messages_sent", double(messages_sent_)},
          {"messages_received", double(messages_received_)},
          {"connections_refused", double(connections_refused_)},
          {"tls_errors", double(tls_errors_)},
          {"connections_idled", double(connections_idled_)}};
}

std::map<std::string, StatsMap> Engine::peer_stats() const {
  std::map<std::string, StatsMap> out;
  std::lock_guard<std::mutex> lock(peers_mutex_);
  const int64_t now = now_ns();
  for (const auto& [key, peer] : peers_) {
    // Several Peer handles to one address are summed into one entry.
    StatsMap& s = out[peer->info.address];
    int64_t busy_ns;
    {
      std::lock_guard<std::mutex> guard(peer->busy_mutex);
      busy_ns = peer->busy_total_ns + (peer->active_transfers > 0 ? now - peer->busy_since_ns : 0);
    }
    s["bytes_sent"] += double(peer->bytes_sent);
    s["chunks_sent"] += double(peer->chunks_sent);
    s["retries"] += double(peer->retries);
    s["transfers_done"] += double(peer->transfers_done);
    s["transfers_failed"] += double(peer->transfers_failed);
    s["seconds_busy"] += double(busy_ns) * 1e-9;
    s["rtt_s"] = std::max(s["rtt_s"], double(peer->rtt_ns) * 1e-9);
    s["connected"] = std::max(s["connected"], peer->alive ? 1.0 : 0.0);
    peer->backend->add_peer_stats(peer->info.key, s);
  }
  for (auto& [address, s] : out) s["throughput_bps"] = s["seconds_busy"] > 0 ? s["bytes_sent"] * 8 / s["seconds_busy"] : 0;
  return out;
}

void Engine::debug_kill_stream(const PeerPtr& peer, uint32_t stream) {
  peer->backend->debug_kill_stream(peer->info.key, stream);
}

void Engine::debug_corrupt_chunks(uint32_t n) { backend_->debug_corrupt_chunks(n); }

}  // namespace pddcore::transfer
