// Engine: lifecycle, regions, peers and the connections that reach them.
#include "engine.h"

#include <algorithm>
#include <stdexcept>

#include "device_memory.h"
#include "tcp/congestion_choice.h"

namespace pddcore::transfer {
namespace {

TransferTags random_transfer_tags() {
  uint64_t keys[4];
  random_bytes(keys, sizeof(keys));
  return TransferTags(keys);
}

}  // namespace

Engine::Engine(EngineOptions options)
    : options_(std::move(options)),
      inbox_(options_.max_inbox_bytes),
      rate_limiter_(options_.rate_limit_bps),
      tags_(random_transfer_tags()) {
  if (!options_.tls_cert_file.empty())  // engine_options() let certificates through only all three together
    tls_ = std::make_unique<TlsContext>(
        TlsCertificates{options_.tls_ca_file, options_.tls_cert_file, options_.tls_key_file});
  else if (options_.tls)
    tls_ = std::make_unique<TlsContext>(options_.auth_token);
  uint16_t port = 0;
  Socket listener = listen_tcp({options_.listen_host, options_.listen_port}, &port);
  address_ = format_address({options_.listen_host, port});
  if (tls_ && tls_->own_engine_id())
    handshake_.engine_id = *tls_->own_engine_id();  // the id its certificate names
  else
    random_bytes(&handshake_.engine_id, sizeof(handshake_.engine_id));
  handshake_.address = address_;
  handshake_.has_token = options_.has_token;
  handshake_.token = options_.auth_token;
  handshake_.timeout_s = options_.timeout_s;
  backends_ = make_backends(*this);
  backend_ = backends_.front().get();
  server_ = std::make_unique<ConnectionServer>(
      std::move(listener), ConnectionServer::limits_for(options_.max_connections, options_.max_connections_per_host),
      [this](Socket& socket, const std::string& host, const ConnectionServer::Authenticated& authenticated) {
        serve_connection(socket, host, authenticated);
      },
      connections_refused_);
  watchdog_thread_ = std::thread([this] { watchdog_loop(); });
}

Engine::~Engine() { close(); }

const char* Engine::backend_name() const { return backend_->name(); }

void Engine::close() {
  std::lock_guard<std::mutex> close_guard(close_mutex_);
  if (closed_) return;
  closed_ = true;
  {
    std::lock_guard<std::mutex> lock(watchdog_mutex_);
    closing_ = true;
  }
  watchdog_wake_.notify_all();
  rate_limiter_.close();
  inbox_.close();
  fences_.close();
  watchdog_thread_.join();
  server_->stop_accepting();
  for (auto& backend : backends_) backend->close();
  server_->close();
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
  const RegionPtr region =
      regions_.add(reinterpret_cast<uint8_t*>(base), size, on_device, target, listed_address, [&](const RegionPtr& r) {
        for (auto& backend : backends_) backend->register_memory(r);
      });
  return region->id;
}

void Engine::unregister_memory(uint64_t region_id) {
  RegionPtr region;
  {
    std::lock_guard<std::mutex> lock(retiring_mutex_);
    auto it = retiring_.find(region_id);
    if (it != retiring_.end()) region = it->second;  // a retry after a timeout: wait again
  }
  if (!region) {
    {
      std::lock_guard<std::mutex> lock(transfers_mutex_);
      for (const auto& [id, active] : active_)
        if (std::count(active.source_regions.begin(), active.source_regions.end(), region_id))
          throw TransferError("region " + std::to_string(region_id) +
                              " is the source of an active transfer; wait for it or cancel it first");
    }
    region = regions_.remove(region_id, [&](uint64_t id) {
      for (auto& backend : backends_) backend->deregister_memory(id);
    });
    std::lock_guard<std::mutex> lock(retiring_mutex_);
    retiring_.emplace(region_id, region);
  }
  // Chunks being sent from or received into the region hold a reference; they finish
  // within a socket deadline. Until they have, the region stays retiring: withdrawn (no new
  // chunk finds it) but not unregistered, so the caller keeps its memory and may retry.
  const std::weak_ptr<const Region> watched = region;
  region.reset();  // what counts is retiring_'s reference and the chunks' (concurrent retries hold none)
  const int64_t deadline = now_ns() + static_cast<int64_t>(options_.timeout_s * 1e9);
  while (watched.use_count() > 1) {
    if (now_ns() > deadline)
      throw TransferError("region " + std::to_string(region_id) +
                          " is still in use by a chunk after timeout_s; it is withdrawn (no new chunk reaches it) but "
                          "stays registered, its memory in use: call unregister again");
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::lock_guard<std::mutex> lock(retiring_mutex_);
  retiring_.erase(region_id);
}

RegionPtr Engine::find_region(uint64_t region_id) { return regions_.find(region_id); }

// ---- peers and connections -------------------------------------------------

Socket Engine::dial(const PeerInfo& peer, wire::ConnKind kind, uint8_t stream, DialAbort* abort) {
  if (closing_) throw TransferError("engine is closed");
  // Data connections run the chosen congestion control; control connections the kernel's.
  // "auto" is chosen per data connection once its handshake measured the path (tcp backend).
  std::string congestion_control;
  if (kind == wire::ConnKind::kData)
    congestion_control = options_.congestion_control == "auto" ? tcp::CongestionRule::kBeforeHandshake
                                                               : options_.congestion_control;
  Socket s = dial_tcp(parse_address(peer.address), options_.timeout_s, congestion_control, abort);
  const DialAbort::Armed armed(abort, s);  // disarmed before s is handed on or closed
  const std::optional<uint64_t> certified = secure(s, true);
  const uint64_t id = dial_handshake(s, handshake_, kind, stream, certified);
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
  const std::optional<uint64_t> certified = secure(peer->control, true);
  peer->info.engine_id = dial_handshake(peer->control, handshake_, wire::ConnKind::kControl, 0, certified);
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
  send_ping(*peer);
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

PeerPtr Engine::find_peer(uint64_t peer_key) const {
  std::lock_guard<std::mutex> lock(peers_mutex_);
  auto it = peers_.find(peer_key);
  return it == peers_.end() ? nullptr : it->second;
}

std::optional<uint64_t> Engine::secure(Socket& s, bool client) const {
  if (!tls_) return std::nullopt;
  // TLS's last handshake flight and our hello leave back to back: with Nagle on, the hello
  // would wait for the peer's delayed ACK (about 40 ms on every connection).
  s.set_nodelay();
  std::unique_ptr<TlsChannel> channel =
      client ? tls_->secure_client(s.fd(), options_.timeout_s) : tls_->secure_server(s.fd(), options_.timeout_s);
  std::optional<uint64_t> certified = channel->certified_peer_id();
  s.attach_tls(std::move(channel));
  return certified;
}

void Engine::serve_connection(Socket& socket, const std::string& host,
                              const ConnectionServer::Authenticated& authenticated) {
  try {
    const std::optional<uint64_t> certified = secure(socket, false);
    const ClientHello hello = accept_handshake(socket, handshake_, certified);
    if (!authenticated()) return;  // the authenticated budget is full
    // A client listening on a wildcard address is reachable at the address it came from.
    HostPort from = parse_address(hello.address);
    if (from.host == "0.0.0.0") from.host = host;
    const std::string from_address = format_address(from);
    socket.set_nodelay();
    if (hello.kind == wire::ConnKind::kControl) serve_control(socket, from_address, hello.engine_id);
    for (auto& backend : backends_)  // a kind no backend serves (e.g. RDMA to a tcp-only engine) is closed
      if (hello.kind == backend->conn_kind()) backend->serve(socket, PeerInfo{0, from_address, hello.engine_id});
  } catch (const TlsError&) {
    ++tls_errors_;  // a failed TLS handshake, or a record that failed its authentication
  } catch (const std::exception&) {
    // A refused, broken or malformed connection affects only itself.
  }
}

void Engine::pace(uint64_t bytes) { rate_limiter_.pace(bytes); }

}  // namespace pddcore::transfer
