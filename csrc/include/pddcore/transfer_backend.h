// The one narrow interface between the transfer engine core and a data-path backend
// (NIXL shape). The core owns regions, peers, the handshake and control connection,
// transfers, notifications, priority messages and stats; a backend only moves chunks of
// registered memory to a peer's registered memory and reports, per chunk, that the peer
// verified and applied it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "pddcore/wire.h"

namespace pddcore::transfer {

// Raised for every transfer-level failure; the message names the cause.
struct TransferError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// A registered memory range. Holders of a RegionPtr keep unregister() waiting, so no
// byte is read or written after the owner got its memory back.
struct Region {
  uint64_t id;
  uint8_t* base;
  uint64_t size;
  bool on_device = false;  // GPU memory: only a path that bypasses the CPU (RDMA) may touch it
  bool target = false;     // peers may write into it; a source is only read by this engine
  bool listed_address = false;  // a target whose virtual address its listing shows (pointer-addressed peers)
};
using RegionPtr = std::shared_ptr<const Region>;

enum class TransferStatus : int { kPending = 0, kDone = 1, kFailed = 2, kCancelled = 3 };

// Where a write lands: bytes [offset, offset + nbytes) of the peer's region.
struct DestinationRange {
  uint64_t region;
  uint64_t offset;
  uint64_t nbytes;
};

// A write_batch in flight. Terminal status is set once; waiters wake then.
class TransferState {
 public:
  TransferState(uint64_t id, uint32_t tag, uint64_t peer_key, uint64_t total_bytes,
                std::vector<DestinationRange> destinations)
      : id(id),
        tag(tag),
        peer_key(peer_key),
        total_bytes(total_bytes),
        destinations(std::move(destinations)),
        started_ns(now_ns()),
        last_progress_ns(started_ns) {}

  const uint64_t id;
  // What the peer fences this transfer by; unpredictable, so no other holder of the token
  // can fence it by guessing (TransferTags).
  const uint32_t tag;
  const uint64_t peer_key;
  const uint64_t total_bytes;
  const std::vector<DestinationRange> destinations;
  const int64_t started_ns;
  std::atomic<uint64_t> bytes_acked{0};
  std::atomic<int64_t> last_progress_ns;

  TransferStatus status() const { return status_.load(std::memory_order_acquire); }
  bool finished() const { return status() != TransferStatus::kPending; }
  std::string error() const;

  // Sets the terminal status; false when another status won the race.
  bool finish(TransferStatus status, std::string error = {});
  // Waits until finished or timeout_s passes (negative: no limit); true when finished.
  bool wait(double timeout_s) const;

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable cv_;
  std::atomic<TransferStatus> status_{TransferStatus::kPending};
  std::string error_;
};
using TransferPtr = std::shared_ptr<TransferState>;

// One piece of a write, at most chunk_bytes long. Holds the source region pinned.
struct WriteChunk {
  TransferPtr transfer;
  RegionPtr src;
  uint64_t src_offset = 0;
  uint64_t dst_region = 0;
  uint64_t dst_offset = 0;
  uint32_t length = 0;
  uint32_t index = 0;     // position within its transfer, so a resent chunk is counted once
  uint32_t attempts = 0;  // sends so far that did not end in an ack
};

// "region R, offset O, length L": names a chunk's destination in error messages.
std::string describe(const WriteChunk& c);

// Who a backend talks to: a peer engine whose control handshake succeeded.
struct PeerInfo {
  uint64_t key = 0;        // the local engine's handle for this peer
  std::string address;     // the peer engine's listen address, "host:port"
  uint64_t engine_id = 0;  // the peer engine's random id
};

struct EngineOptions {
  std::string backend = "tcp";
  std::string listen_host = "127.0.0.1";
  uint16_t listen_port = 0;
  uint32_t streams = 4;
  uint32_t chunk_bytes = 1u << 20;
  bool has_token = false;
  std::string auth_token;
  bool tls = false;  // TLS 1.3 on every connection: keyed by the auth token, or with certificates (tls.h)
  // Certificate mode (all three, PEM): the deployment's CA, this engine's certificate (its
  // subject common name is the engine's name, from which its engine id comes) and key.
  std::string tls_ca_file, tls_cert_file, tls_key_file;
  std::string congestion_control;  // TCP_CONGESTION of the data connections we dial ("": the kernel's default)
  double timeout_s = 30.0;
  double rate_limit_bps = 0.0;  // bits per second; 0: unlimited
  // TCP: pace each peer's bulk data so the path's queueing delay stays near this (0: off).
  double queue_delay_target_s = 0.0;
  uint32_t max_retries = 5;     // resends of one chunk, and reconnects of one stream, before giving up
  // Connections this engine serves at once, in all and from one IP address (counted from
  // accept, before authentication); beyond them a new connection is closed at once.
  uint32_t max_connections = 1024;
  uint32_t max_connections_per_host = 256;
  // Bytes of received messages and notifications waiting for poll_messages(); a peer whose
  // next one would exceed it waits (its control connection stalls) until there is room.
  uint64_t max_inbox_bytes = 64ull << 20;
  // A data connection that carries nothing for this long is closed by the receiver; the
  // sender dials again when it has chunks for that stream.
  double idle_timeout_s = 300.0;
  // RDMA backend: device name ("": first device; "emulator": the verbs emulator), port, GID index (-1: auto).
  std::string rdma_device;
  uint8_t ib_port = 1;
  int gid_index = -1;
};

class Socket;
class DialAbort;

// The engine core, as seen by a backend.
class BackendHost {
 public:
  virtual ~BackendHost() = default;
  virtual const EngineOptions& options() const = 0;

  // Sender side. The peer verified and applied this chunk.
  virtual void chunk_applied(const WriteChunk& chunk) = 0;
  // The chunk will be sent again (lost connection or a CRC mismatch at the peer).
  virtual void chunk_retried(const WriteChunk& chunk, const std::string& why) = 0;
  // The transfer cannot complete; the core fails it with this reason.
  virtual void transfer_failed(const TransferPtr& transfer, const std::string& why) = 0;
  // Blocks until the rate limit admits `bytes` more (or the engine closes).
  virtual void pace(uint64_t bytes) = 0;
  // Opens an authenticated connection of `kind` to a peer (the core's handshake).
  // `abort`: null, or lets another thread end the dial while it waits on the peer.
  virtual Socket dial(const PeerInfo& peer, wire::ConnKind kind, uint8_t stream, DialAbort* abort) = 0;

  // Receiver side. Null when no region has this id.
  virtual RegionPtr find_region(uint64_t region_id) = 0;
  virtual void chunk_received(uint64_t bytes, wire::AckStatus status) = 0;
  // Receiver side of cancel fences: a chunk of (sender engine, transfer tag) is about to be
  // written (false: that transfer is fenced, drop the chunk), and is done being written.
  virtual bool begin_receive(uint64_t sender_engine_id, uint32_t transfer_tag) = 0;
  // A served connection was closed for carrying nothing for idle_timeout_s.
  virtual void connection_idled() = 0;
  virtual void end_receive(uint64_t sender_engine_id, uint32_t transfer_tag) = 0;
};

class TransferBackend {
 public:
  virtual ~TransferBackend() = default;
  virtual const char* name() const = 0;
  // The kind of incoming connection the engine hands to serve().
  virtual wire::ConnKind conn_kind() const { return wire::ConnKind::kData; }

  // Memory registration hooks (RDMA pins and registers an MR; TCP needs nothing).
  virtual void register_memory(const RegionPtr& region) = 0;
  virtual void deregister_memory(uint64_t region_id) = 0;

  // Sets up the data path to a peer after the core's control handshake succeeded.
  virtual void connect(const PeerInfo& peer) = 0;
  virtual void disconnect(uint64_t peer_key) = 0;

  // Queues chunks for a connected peer. Each chunk ends in host.chunk_applied or, for
  // its transfer, host.transfer_failed; chunks of finished transfers are dropped.
  virtual void post(uint64_t peer_key, std::vector<WriteChunk> chunks) = 0;
  // Drops every queued and unacknowledged chunk of a finished transfer, unpinning its regions.
  virtual void purge(const TransferState& transfer) = 0;
  // After purge on cancel: returns once nothing of the transfer can still reach the peer
  // from this side (RDMA: its posted WRs completed), or at deadline_ns. The receiver's fence
  // covers what is already on the wire.
  virtual void drain(const TransferState& /*transfer*/, int64_t /*deadline_ns*/) {}

  // An authenticated data connection accepted on the engine's port: serves it on the
  // calling thread until it closes. The core owns the socket and shuts it down on close.
  virtual void serve(const Socket& socket, const PeerInfo& from) = 0;

  // Stops all threads and closes all connections; idempotent.
  virtual void close() = 0;

  // Test hooks: break one data stream's connection; corrupt the next n payloads sent.
  virtual void debug_kill_stream(uint64_t peer_key, uint32_t stream) = 0;
  virtual void debug_corrupt_chunks(uint32_t n) = 0;

  // Backend-specific numbers for one peer's entry in the engine's stats.
  virtual void add_peer_stats(uint64_t /*peer_key*/, std::map<std::string, double>& /*stats*/) {}
};

}  // namespace pddcore::transfer
