// The transfer engine core, shared by every backend: it ties the parts together (region
// registry, listener, control connections, transfers, watchdog, rate limit, stats) and
// implements the BackendHost a backend sees. Data moves through a TransferBackend
// (tcp/, rdma/). Its methods live in one file per job:
//   engine.cpp            lifecycle, regions, peers and their connections
//   engine_control.cpp    the control protocol (messages, notifications, pings, fences, listings)
//   engine_transfers.cpp  transfer bookkeeping: write_batch, per-chunk progress, cancel, completion
//   engine_watchdog.cpp   stalled transfers and keep-alive pings
//   engine_stats.cpp      the stats() numbers and test hooks
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include "connection_server.h"
#include "fence_table.h"
#include "handshake.h"
#include "inbox.h"
#include "pddcore/transfer_backend.h"
#include "rate_limiter.h"
#include "region_registry.h"
#include "socket.h"
#include "tls.h"
#include "transfer_tags.h"

namespace pddcore::transfer {

// One write of a batch: nbytes from a local region to a peer's region.
struct WriteOp {
  uint64_t src_region;
  uint64_t src_offset;
  uint64_t dst_region;
  uint64_t dst_offset;
  uint64_t nbytes;
};

// A connected peer engine: its control connection and what we sent it.
struct Peer {
  PeerInfo info;
  TransferBackend* backend = nullptr;  // this peer's data path
  Socket control;
  std::mutex send_mutex;
  std::thread reader;
  std::atomic<bool> alive{true};
  std::string lost_reason;  // under send_mutex

  std::mutex reply_mutex;
  std::condition_variable reply_cv;
  uint64_t region_lists_received = 0;  // under reply_mutex
  std::vector<wire::RegionEntry> region_list;
  // The peer's answer to our last fence of each transfer tag: true confirmed, false busy (a
  // chunk of it was still being written); under reply_mutex, taken by cancel().
  std::map<uint32_t, bool> fence_replies;

  std::atomic<uint64_t> bytes_sent{0}, chunks_sent{0}, retries{0}, transfers_done{0}, transfers_failed{0};
  std::atomic<int64_t> rtt_ns{0};
  std::atomic<int64_t> last_ack_ns{now_ns()};  // a peer acking anything is alive
  std::mutex busy_mutex;  // guards the three below
  int active_transfers = 0;
  int64_t busy_since_ns = 0;
  int64_t busy_total_ns = 0;
};
using PeerPtr = std::shared_ptr<Peer>;

using StatsMap = std::map<std::string, double>;

class Engine final : public BackendHost {
 public:
  // `options` as engine_options() (engine_arguments.h) returns them: checked there, and only there.
  explicit Engine(EngineOptions options);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Stops every thread, closes every socket, fails what is still in flight; idempotent.
  void close();

  const std::string& address() const { return address_; }
  uint64_t engine_id() const { return handshake_.engine_id; }
  const char* backend_name() const;

  // target: peers may write into the region; otherwise it is a source, only read here.
  // listed_address: a target's listing shows its virtual address (else 0).
  uint64_t register_memory(uintptr_t base, uint64_t size, bool target, bool listed_address);
  // Refuses while the region is the source of an active transfer; otherwise withdraws it
  // (no new chunk finds it) and waits (up to timeout_s) until no chunk reads or writes it any
  // more. On that timeout it throws and the region stays retiring: a later call waits again,
  // and returns once the last chunk let go.
  void unregister_memory(uint64_t region_id);

  // backend: the data path to this peer ("": the engine's default backend).
  PeerPtr connect(const std::string& address, const std::string& backend = "");
  // Closes the peer's connections and fails its transfers in flight.
  void disconnect(const PeerPtr& peer);
  TransferPtr write_batch(const PeerPtr& peer, const std::vector<WriteOp>& ops, std::optional<std::string> notify);
  // Stops the transfer, then returns once the peer confirmed that none of its chunks will be
  // written any more (a fence), so the destination can be reused at once; on a failed
  // transfer, only the fence. The peer confirms only once no chunk of it is being written
  // (it answers busy meanwhile, and is asked again). Throws TransferError when the peer does
  // not confirm within timeout_s: the destination ranges then stay quarantined (write_batch
  // refuses to write into them) until a later cancel() of the transfer is confirmed.
  // No-op once done.
  void cancel(const TransferPtr& transfer);
  // A priority-lane message: written at once on the peer's control connection.
  void send(const PeerPtr& peer, const std::string& message);
  // Messages and notifications received since the last call, in arrival order. Waits up to
  // timeout_s (0: not at all) for the first one when there is none.
  std::vector<InboxEntry> poll_messages(double timeout_s);
  // The peer's registered regions (for adapters that address memory by pointer).
  std::vector<wire::RegionEntry> remote_regions(const PeerPtr& peer);

  StatsMap totals() const;
  std::map<std::string, StatsMap> peer_stats() const;

  void debug_kill_stream(const PeerPtr& peer, uint32_t stream);
  void debug_corrupt_chunks(uint32_t n);

  // BackendHost
  const EngineOptions& options() const override { return options_; }
  void chunk_applied(const WriteChunk& chunk) override;
  void chunk_retried(const WriteChunk& chunk, const std::string& why) override;
  void transfer_failed(const TransferPtr& transfer, const std::string& why) override;
  void pace(uint64_t bytes) override;
  Socket dial(const PeerInfo& peer, wire::ConnKind kind, uint8_t stream, DialAbort* abort) override;
  RegionPtr find_region(uint64_t region_id) override;
  void chunk_received(uint64_t bytes, wire::AckStatus status) override;
  bool begin_receive(uint64_t sender_engine_id, uint32_t transfer_tag) override;
  void connection_idled() override { ++connections_idled_; }
  void end_receive(uint64_t sender_engine_id, uint32_t transfer_tag) override;

 private:
  struct ActiveTransfer {
    TransferPtr transfer;
    PeerPtr peer;
    std::optional<std::string> notify;
    std::vector<uint64_t> source_regions;
    std::vector<bool> chunk_acked;
  };

  // Runs TLS (when on) on a fresh connection; returns the engine id the peer's certificate
  // names (certificate mode), which the handshake then holds the peer to.
  std::optional<uint64_t> secure(Socket& s, bool client) const;
  // Serves an accepted connection: TLS, the handshake, then control or a backend's data.
  void serve_connection(Socket& socket, const std::string& host, const ConnectionServer::Authenticated& authenticated);
  void serve_control(const Socket& s, const std::string& from, uint64_t from_engine_id);
  void read_control_replies(const PeerPtr& peer);
  void watchdog_loop();
  void fail_stalled_transfers(int64_t now);
  void ping_peers();
  void send_control(Peer& peer, wire::ControlType type, const std::string& payload);
  // A ping carrying the send time; the pong's echo gives the peer's RTT.
  void send_ping(Peer& peer);
  // Ends a transfer once: records stats, unpins, purges the backend's queues.
  // `peer` is needed only once the transfer has left active_ (its completion path).
  void finish_transfer(const TransferPtr& transfer, TransferStatus status, const std::string& error,
                       PeerPtr peer = nullptr);
  void complete_transfer(ActiveTransfer active);
  PeerPtr find_peer(uint64_t peer_key) const;
  // Asks the peer to fence the transfer until it confirms or deadline_ns passes; true: confirmed.
  bool fence(Peer& peer, const TransferState& transfer, int64_t deadline_ns);
  // Throws TransferError when a write of `peer_key` into `range` would overlap a quarantined
  // transfer's destination; under transfers_mutex_.
  void check_not_quarantined(uint64_t peer_key, const DestinationRange& range) const;

  EngineOptions options_;
  HandshakeConfig handshake_;
  std::unique_ptr<TlsContext> tls_;  // set with options_.tls
  std::string address_;
  std::vector<std::unique_ptr<TransferBackend>> backends_;  // every data path this engine serves
  TransferBackend* backend_ = nullptr;                     // the default one (backends_.front())

  std::atomic<bool> closing_{false};
  std::mutex close_mutex_;
  bool closed_ = false;

  RegionRegistry regions_;
  std::mutex retiring_mutex_;
  std::unordered_map<uint64_t, RegionPtr> retiring_;  // withdrawn, a chunk still held them at the last unregister
  Inbox inbox_;
  FenceTable fences_;
  RateLimiter rate_limiter_;
  std::unique_ptr<ConnectionServer> server_;

  mutable std::mutex peers_mutex_;
  std::map<uint64_t, PeerPtr> peers_;
  uint64_t next_peer_key_ = 1;

  mutable std::mutex transfers_mutex_;
  std::unordered_map<uint64_t, ActiveTransfer> active_;
  uint64_t next_transfer_id_ = 1;
  const TransferTags tags_;
  // Transfers being cancelled, or whose cancel the peer did not confirm: bytes of them may
  // still land, so no new write may target their destination ranges.
  std::unordered_map<uint64_t, TransferPtr> quarantined_;

  std::mutex watchdog_mutex_;
  std::condition_variable watchdog_wake_;  // notified on close
  std::thread watchdog_thread_;

  std::atomic<uint64_t> bytes_sent_{0}, chunks_sent_{0}, bytes_received_{0}, chunks_received_{0}, retries_{0},
      crc_errors_{0}, chunks_rejected_{0}, transfers_done_{0}, transfers_failed_{0}, transfers_cancelled_{0},
      messages_sent_{0}, messages_received_{0}, connections_refused_{0}, tls_errors_{0},
      connections_idled_{0};
};

// Creates the backend named in options.backend; throws std::invalid_argument listing
// the backends available in this build for an unknown name.
std::unique_ptr<TransferBackend> make_backend(BackendHost& host);
// The default backend first, then tcp when the default is another: an engine always
// speaks tcp too, so it can reach (and serve) peers without the default's hardware.
std::vector<std::unique_ptr<TransferBackend>> make_backends(BackendHost& host);

}  // namespace pddcore::transfer
