// TCP data path: each peer gets `streams` connections; each stream's writer pulls chunks
// from the peer's shared queue and keeps up to a window of them unacknowledged, so a long
// fat pipe stays full. A stream that breaks hands its unacknowledged chunks back to the
// queue (the other streams pick them up) and reconnects, within the retry budget.
// Receiving, each chunk's payload is read straight into the registered destination and
// its CRC32C checked before the ack.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../socket.h"
#include "congestion_choice.h"
#include "delay_pacer.h"
#include "delivery_meter.h"
#include "pddcore/transfer_backend.h"

namespace pddcore::transfer::tcp {

class TcpBackend final : public TransferBackend {
 public:
  explicit TcpBackend(BackendHost& host);
  ~TcpBackend() override;

  const char* name() const override { return "tcp"; }
  void register_memory(const RegionPtr& region) override;
  void deregister_memory(uint64_t region_id) override;
  void connect(const PeerInfo& peer) override;
  void disconnect(uint64_t peer_key) override;
  void post(uint64_t peer_key, std::vector<WriteChunk> chunks) override;
  void purge(const TransferState& transfer) override;
  void serve(const Socket& socket, const PeerInfo& from) override;
  void close() override;
  void debug_kill_stream(uint64_t peer_key, uint32_t stream) override;
  void debug_corrupt_chunks(uint32_t n) override;
  void add_peer_stats(uint64_t peer_key, std::map<std::string, double>& stats) override;

 private:
  struct Stream {
    uint32_t index = 0;
    std::thread thread;
    // Under Link::mutex:
    const Socket* socket = nullptr;          // the live connection, if any
    DialAbort dial_abort;                    // stop_link ends a dial still waiting on the peer
    std::map<uint64_t, WriteChunk> inflight;  // sent, not yet acknowledged, by sequence number
    uint64_t inflight_bytes = 0;
    uint64_t next_seq = 1;
    // congestion_control="auto": what this connection's handshake measured, and the
    // algorithm chosen from it (or on loss).
    double handshake_rtt_s = 0;
    const char* algorithm = nullptr;
    LossCount loss_count;  // while it runs cubic (congestion_choice.h)
    bool loss_based = true;  // the connection's algorithm backs off on loss (not bbr)
  };
  struct Link {
    PeerInfo peer;
    std::mutex mutex;
    std::condition_variable cv;  // queue, window space, a broken session, stopping
    std::deque<WriteChunk> queue;
    std::vector<std::unique_ptr<Stream>> streams;
    uint32_t live_streams = 0;
    bool stopping = false;
    std::string dead_reason;  // set once every stream gave up
    bool lossy = false;               // "auto": a connection saw loss; every connection runs bbr
    uint32_t congestion_switches = 0;  // "auto": live connections switched to bbr on loss
    uint64_t warmup_bytes = 0;         // padding sent to warm fresh connections (warmup.h)
    // What the kernel measures on the streams, read together (the three under path_mutex,
    // which observe_path holds while it takes `mutex` to read them: never the other way
    // round): with queue_delay_target_s a pacer paces this peer's bulk data to the path;
    // the meter measures the path's rate for stats().
    std::unique_ptr<DelayPacer> pacer;
    DeliveryMeter delivery;
    std::mutex path_mutex;
    int64_t last_path_sample_ns = 0;
    // streams="auto": the meter's counters when the stream count was last judged.
    double judged_bytes = 0, judged_seconds = 0;
  };
  using LinkPtr = std::shared_ptr<Link>;

  void run_stream(const LinkPtr& link, Stream& stream);
  // Sends chunks until the connection breaks or the link stops; returns whether the
  // peer acknowledged anything, throws TransferError with the reason it broke.
  bool run_session(Link& link, Stream& stream, const Socket& socket);
  void read_acks(Link& link, Stream& stream, const Socket& socket, std::atomic<bool>& broken,
                 std::atomic<bool>& progressed, std::string& error);
  // Acts on one ack; `chunk` is empty for an ack of a chunk no longer in flight. Returns
  // false when the ack says the peer closed the connection.
  bool settle(Link& link, wire::AckStatus status, std::optional<WriteChunk>& chunk, uint32_t max_retries);
  struct Outgoing {
    WriteChunk chunk;
    uint64_t seq;
  };
  // On a long path with nothing queued, sends padding until the fresh connection is past
  // its ramp (warmup.h); returns at once when data is queued or the session breaks.
  void warm_up(Link& link, Stream& stream, const Socket& socket, const std::atomic<bool>& broken);
  // Sends a batch of chunks: small ones in one gather write with the CRC32C in the header,
  // a big one slice by slice with the CRC32C in a trailer (see wire::ChunkHeader).
  void send_chunks(const Socket& socket, const std::vector<Outgoing>& batch);
  // Feeds the link's meter (and pacer) what the kernel measured on every stream, all at one
  // moment (at most once a millisecond; called as batches leave and as acks arrive).
  void observe_path(Link& link);
  // congestion_control="auto": sets a freshly dialled connection's algorithm from its
  // handshake's RTT (or the link's loss); see congestion_choice.h.
  void choose_congestion_control(Link& link, Stream& stream, const Socket& socket);
  // "auto", under link.mutex: on a cubic connection's retransmits, switches the link to bbr.
  void switch_on_loss(Link& link, const PathSample& sample, Stream& stream);
  // streams="auto", under link.path_mutex: judges the stream count from the path's rate
  // over the path-limited time since the last judgement, the RTT and the loss in `samples`
  // (stream_choice.h); returns how many streams the link should have (0: no judgement yet).
  uint32_t judge_streams(Link& link, const std::vector<std::pair<uint32_t, PathSample>>& samples, double loss,
                         bool loss_based);
  // Dials streams until the link has `count` (never fewer than it has).
  void add_streams(uint64_t peer_key, uint32_t count);
  // Bytes one batch may carry: fewer while the link's pacer paces.
  uint64_t batch_limit(Link& link);
  // Waits as long as the link's pacer says before `bytes` may leave (no-op without a pacer).
  void pace_to_path(Link& link, uint64_t bytes, const std::atomic<bool>& broken);
  // Returns a session's unacknowledged chunks to the queue, or fails their transfers
  // once a chunk is out of retries.
  void requeue_inflight(Link& link, Stream& stream, const std::string& why);
  void fail_queued(Link& link, const std::string& why);
  void stop_link(const LinkPtr& link);
  LinkPtr find_link(uint64_t peer_key);

  BackendHost& host_;
  const uint64_t window_bytes_;
  const bool auto_congestion_;  // congestion_control="auto"
  const bool auto_streams_;     // streams="auto" (options().streams == 0)
  const uint64_t send_buffer_bytes_;  // one connection's send-buffer ceiling (tcp_wmem)
  std::mutex mutex_;
  std::map<uint64_t, LinkPtr> links_;
  bool closed_ = false;
  std::atomic<uint32_t> corrupt_next_{0};
};

}  // namespace pddcore::transfer::tcp
