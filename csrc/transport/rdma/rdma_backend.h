// RDMA data path (ibverbs, reliable connected). Per connected peer: a setup connection
// through the engine's authenticated handshake, over which QP attributes (LID/GID, QPN,
// PSN, MTU) are exchanged and destination regions' (address, rkey) looked up; and one or
// more RC QPs. A write's chunks are posted as a chain of RDMA WRITE work requests, every
// kSignalEvery-th signaled, the last one RDMA_WRITE_WITH_IMM (signaled) so the target
// learns of it; the immediate carries the bytes written since the previous one. A chunk
// counts as applied when a signaled completion covers it: RC acknowledges a WR only
// after the responder placed its data, and in order.
//
// One progress thread polls every QP's completion queue, posts queued chunks as send-queue
// slots free up, reposts the target's receives, and repairs a QP that entered the error
// state (new QPs on both sides, over the setup connection). A completion error fails its
// transfer with the ibv_wc_status_str text; a vanished peer shows up as "transport retry
// counter exceeded" after the ACK timeout, which is derived from the engine's timeout_s.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "../socket.h"
#include "pddcore/transfer_backend.h"
#include "verbs_device.h"

namespace pddcore::rdma {

class RdmaBackend final : public transfer::TransferBackend {
 public:
  // Opens the device now: throws TransferError when none is usable (the message lists the
  // backends that are).
  RdmaBackend(transfer::BackendHost& host, const DeviceChoice& choice);
  ~RdmaBackend() override;

  const char* name() const override { return "rdma"; }
  wire::ConnKind conn_kind() const override { return wire::ConnKind::kRdmaSetup; }
  // "<device> via <libibverbs | verbs emulator>"
  std::string device_description() const;

  void register_memory(const transfer::RegionPtr& region) override;
  void deregister_memory(uint64_t region_id) override;
  void connect(const transfer::PeerInfo& peer) override;
  void disconnect(uint64_t peer_key) override;
  void post(uint64_t peer_key, std::vector<transfer::WriteChunk> chunks) override;
  void purge(const transfer::TransferState& transfer) override;
  void drain(const transfer::TransferState& transfer, int64_t deadline_ns) override;
  void serve(const transfer::Socket& socket, const transfer::PeerInfo& from) override;
  void close() override;
  // Moves one of the peer's QPs to the error state, as a fabric fault would.
  void debug_kill_stream(uint64_t peer_key, uint32_t stream) override;
  // RDMA has no payload checksum of ours to corrupt (the fabric's ICRC covers it): no-op.
  void debug_corrupt_chunks(uint32_t n) override;

  static constexpr uint32_t kSendDepth = 512;   // send-queue slots per QP
  static constexpr uint32_t kSignalEvery = 16;  // at least every 16th WR is signaled
  static constexpr uint32_t kRecvDepth = kSendDepth;  // receives for immediates per target QP
  static constexpr size_t kMaxTargetQps = 4 * setup::kMaxQps;  // per setup connection (repairs included)

 private:
  struct Posted {
    uint64_t seq;
    transfer::WriteChunk chunk;
  };
  // A sender QP with the chunks queued for it and the WRs it has outstanding.
  struct Endpoint {
    std::unique_ptr<QueuePair> qp;
    std::deque<transfer::WriteChunk> pending;
    std::deque<Posted> posted;  // posted, not yet retired by a (signaled or error) completion
    uint64_t next_seq = 1;
    uint32_t since_signal = 0;
    uint64_t bytes_since_imm = 0;
    uint32_t remote_qpn = 0;
    bool tail_signaled = true;  // the last posted WR is signaled (so every posted WR retires)
    uint64_t tail_remote_addr = 0;
    uint32_t tail_rkey = 0;
    std::string broken;  // why the QP entered the error state
  };
  struct Link {
    transfer::PeerInfo peer;
    transfer::Socket setup;
    std::mutex setup_mutex;  // one request/reply at a time on `setup`
    // Under RdmaBackend::mutex_ (written with setup_mutex held too):
    std::unordered_map<uint64_t, setup::RegionKey> remote_regions;
    std::vector<std::unique_ptr<Endpoint>> endpoints;
    size_t next_endpoint = 0;
    std::string dead;  // the link carries no more writes
    bool repairing = false;
    std::deque<std::vector<transfer::WriteChunk>> unresolved;  // batches naming regions not asked about yet
    bool resolving = false;
    bool stop_resolver = false;
    std::condition_variable resolve_cv;
    std::thread resolver;
  };
  using LinkPtr = std::shared_ptr<Link>;
  // The target side of one peer's setup connection: QPs that receive writes.
  struct Target {
    const transfer::Socket* socket;
    std::vector<std::unique_ptr<QueuePair>> qps;
  };
  struct LocalRegion {
    ibv_mr* mr;
    bool target;  // registered with REMOTE_WRITE, and its rkey handed out
  };
  using Callback = std::function<void()>;
  using Failures = std::vector<std::pair<transfer::TransferPtr, std::string>>;

  // Why chunk `c` may not be written into the region described by `key` ("" if it may).
  static std::string verdict(const setup::RegionKey& key, const transfer::WriteChunk& c);
  // Queues checked chunks on one of the link's QPs (whole transfers are rejected or not).
  void admit_locked(Link& link, std::vector<transfer::WriteChunk>& chunks, const std::vector<std::string>& verdicts,
                    Failures& failures, std::vector<Callback>& callbacks);
  void resolve_loop(const LinkPtr& link);
  void stop_resolver(Link& link);
  void progress_loop();
  // Polls one sender QP's CQ; queues host callbacks. Returns completions seen.
  int poll_sender(Link& link, Endpoint& ep, std::vector<Callback>& callbacks);
  int poll_target(Target& target, std::vector<Callback>& callbacks);
  // Posts queued chunks while send-queue slots are free.
  void pump(Link& link, Endpoint& ep, std::vector<Callback>& callbacks);
  // When the last posted WR is unsignaled and nothing will follow it (a purge emptied the
  // queue), posts a signaled zero-length write so the WRs before it complete and release
  // their source regions.
  void seal_locked(Endpoint& ep);
  // New QPs for a link whose QPs failed, keeping their queued chunks.
  void repair(const LinkPtr& link);
  // Creates `n` sender QPs and connects them with the peer's over the setup connection.
  std::vector<std::unique_ptr<Endpoint>> open_endpoints(Link& link, uint32_t n);
  // The destination region's address and rkey (asked from the peer once, then cached per
  // link) and the verdict on writing [offset, offset + length) into it.
  setup::RegionKey remote_region(Link& link, uint64_t region_id, uint64_t offset, uint64_t length);
  // Rate limiting (only when the engine has one): queued bytes wait for credit that the
  // pacer thread buys from the engine's limiter.
  void add_demand(uint64_t bytes);
  void pacer_loop();
  void fail_link_locked(Link& link, const std::string& why, std::vector<Callback>& callbacks);
  LinkPtr find_link(uint64_t peer_key);

  transfer::BackendHost& host_;
  std::unique_ptr<VerbsDevice> device_;
  const uint32_t qps_per_peer_;

  std::mutex mutex_;
  std::condition_variable targets_cv_;  // a serve() call returned
  std::map<uint64_t, LinkPtr> links_;
  std::vector<Target*> targets_;
  std::unordered_map<uint64_t, LocalRegion> regions_;
  bool closed_ = false;

  const bool rate_limited_;
  uint64_t demand_ = 0;  // under mutex_: queued bytes not yet paced
  uint64_t credit_ = 0;  // under mutex_: paced bytes not yet posted
  std::condition_variable pacer_cv_;

  std::atomic<bool> stopping_{false};
  std::thread progress_;
  std::thread pacer_;
};

}  // namespace pddcore::rdma
