#include "tcp_backend.h"

#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <optional>
#include <set>

#include "../peer_links.h"
#include "congestion_choice.h"
#include "path_sample.h"
#include "pddcore/crc32c.h"
#include "stream_choice.h"
#include "warmup.h"

namespace pddcore::transfer::tcp {

namespace {

// Chunks bigger than this go to and come from the kernel a piece at a time, each piece
// checksummed right after the kernel's copy, so the checksum reads it from cache (smaller
// chunks are checksummed into their header just before). 256 KiB measured best on
// loopback: 1 MiB pieces fall out of L2 next to the kernel's own copies, 64 KiB pieces
// cost more in syscalls than they save.
constexpr size_t kCrcPiece = 256 << 10;
constexpr uint64_t kMinWindowBytes = 16ull << 20;
// How often a link's streams are read (TCP_INFO) for its meter and pacer.
constexpr int64_t kPathSampleIntervalNs = 1'000'000;
// While paced, a batch carries about this much time at the paced rate.
constexpr double kPacedBurstS = 0.001;
// One sendmsg carries up to this many small chunks, checksummed just before it.
constexpr size_t kMaxBatchChunks = 16;
constexpr uint64_t kMaxBatchBytes = kCrcPiece;
// Padding goes out this much per frame (a warm-up frame's payload: zeros).
constexpr size_t kWarmupFrameBytes = 64 << 10;
// streams="auto" judges the stream count over at least this much path-limited time, and
// over this many minimum RTTs at least: a rate over a shorter stretch is one burst's.
constexpr double kJudgeMinS = 0.02;
constexpr double kJudgeRtts = 10;

// The kernel's ceiling on one connection's send buffer (tcp_wmem's third field, in this
// network namespace); Linux's default where it cannot be read.
uint64_t send_buffer_ceiling() {
  std::ifstream f("/proc/sys/net/ipv4/tcp_wmem");
  uint64_t min = 0, initial = 0, max = 0;
  if (f >> min >> initial >> max && max > 0) return max;
  return 4ull << 20;
}

// Acks for verified chunks wait here while more chunks are already queued on the socket,
// and go out in one send once the socket runs dry (or a batch is full): one syscall per
// burst instead of one per chunk. An ack is still only ever sent after its chunk's check.
class AckBatch {
 public:
  explicit AckBatch(const Socket& socket) : socket_(socket) {}
  void add(wire::AckStatus status, uint64_t seq, uint64_t bytes) {
    wire::Ack ack;
    ack.status = status;
    ack.seq = seq;
    ack.encode(buf_ + count_ * wire::Ack::kSize);
    bytes_ += bytes;
    // Flushing by bytes too keeps the sender's window open while data streams in.
    if (++count_ == kMaxAcks || bytes_ >= kMaxBytes) flush();
  }
  void flush() {
    if (count_ == 0) return;
    socket_.send_all(buf_, count_ * wire::Ack::kSize);
    count_ = 0;
    bytes_ = 0;
  }
  bool empty() const { return count_ == 0; }

 private:
  static constexpr size_t kMaxAcks = 64;
  static constexpr uint64_t kMaxBytes = 4ull << 20;
  const Socket& socket_;
  uint8_t buf_[kMaxAcks * wire::Ack::kSize];
  size_t count_ = 0;
  uint64_t bytes_ = 0;
};

// Holds a chunk's place in its transfer's fence while the chunk is written.
class ReceiveGuard {
 public:
  ReceiveGuard(BackendHost& host, uint64_t sender, uint32_t tag) : host_(host), sender_(sender), tag_(tag) {}
  ~ReceiveGuard() { host_.end_receive(sender_, tag_); }
  ReceiveGuard(const ReceiveGuard&) = delete;
  ReceiveGuard& operator=(const ReceiveGuard&) = delete;

 private:
  BackendHost& host_;
  uint64_t sender_;
  uint32_t tag_;
};

}  // namespace

TcpBackend::TcpBackend(BackendHost& host)
    : host_(host),
      window_bytes_(std::max<uint64_t>(kMinWindowBytes, 4ull * host.options().chunk_bytes)),
      auto_congestion_(host.options().congestion_control == "auto"),
      auto_streams_(host.options().streams == 0),
      send_buffer_bytes_(send_buffer_ceiling()) {}

TcpBackend::~TcpBackend() { close(); }

// TCP reads and writes registered memory in place: nothing to pin or register.
void TcpBackend::register_memory(const RegionPtr&) {}
void TcpBackend::deregister_memory(uint64_t) {}

// ---- sender ----------------------------------------------------------------

void TcpBackend::connect(const PeerInfo& peer) {
  auto link = std::make_shared<Link>();
  link->peer = peer;
  const uint32_t n = auto_streams_ ? StreamRule::kInitial : host_.options().streams;
  // streams="auto" may add streams later: the pacer has a place for as many as it may get.
  if (host_.options().queue_delay_target_s > 0)
    link->pacer = std::make_unique<DelayPacer>(host_.options().queue_delay_target_s,
                                               auto_streams_ ? StreamRule::kMax : n);
  link->live_streams = n;
  for (uint32_t i = 0; i < n; ++i) {
    link->streams.push_back(std::make_unique<Stream>());
    link->streams.back()->index = i;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (closed_) throw TransferError("engine is closed");
  links_.emplace(peer.key, link);
  for (auto& stream : link->streams) {
    Stream* s = stream.get();
    s->thread = std::thread([this, link, s] { run_stream(link, *s); });
  }
}

void TcpBackend::add_streams(uint64_t peer_key, uint32_t count) {
  LinkPtr link = find_link(peer_key);
  if (!link) return;
  std::lock_guard<std::mutex> lock(link->mutex);
  // Once stopping, stop_link joins the streams without the lock: none may be added then.
  if (link->stopping || !link->dead_reason.empty()) return;
  while (link->streams.size() < count) {
    link->streams.push_back(std::make_unique<Stream>());
    Stream* s = link->streams.back().get();
    s->index = static_cast<uint32_t>(link->streams.size() - 1);
    ++link->live_streams;
    s->thread = std::thread([this, link, s] { run_stream(link, *s); });
  }
}

TcpBackend::LinkPtr TcpBackend::find_link(uint64_t peer_key) { return find_peer_link(mutex_, links_, peer_key); }

// An rdma engine's tcp path may be handed its GPU regions: it can read none of them.
static std::string device_source(const std::vector<WriteChunk>& chunks) {
  for (const WriteChunk& c : chunks)
    if (c.src->on_device) return "source region " + std::to_string(c.src->id) + " is GPU memory, which the tcp path cannot read";
  return "";
}

void TcpBackend::post(uint64_t peer_key, std::vector<WriteChunk> chunks) {
  LinkPtr link = find_link(peer_key);
  std::string dead = device_source(chunks);
  if (dead.empty() && !link) {
    dead = "peer is not connected";
  } else if (dead.empty()) {
    std::lock_guard<std::mutex> lock(link->mutex);
    if (!link->dead_reason.empty() || link->stopping) {
      dead = link->dead_reason.empty() ? "peer is disconnected" : link->dead_reason;
    } else {
      for (auto& c : chunks) link->queue.push_back(std::move(c));
    }
  }
  if (!dead.empty()) {
    if (!chunks.empty()) host_.transfer_failed(chunks.front().transfer, dead);
    return;
  }
  link->cv.notify_all();
}

void TcpBackend::purge(const TransferState& transfer) {
  LinkPtr link = find_link(transfer.peer_key);
  if (!link) return;
  std::vector<WriteChunk> dropped;  // released outside the lock
  {
    std::lock_guard<std::mutex> lock(link->mutex);
    auto& q = link->queue;
    for (auto it = q.begin(); it != q.end();) {
      if (it->transfer.get() == &transfer) {
        dropped.push_back(std::move(*it));
        it = q.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& stream : link->streams) {
      for (auto it = stream->inflight.begin(); it != stream->inflight.end();) {
        if (it->second.transfer.get() == &transfer) {
          stream->inflight_bytes -= it->second.length;
          dropped.push_back(std::move(it->second));
          it = stream->inflight.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
  link->cv.notify_all();
}

void TcpBackend::run_stream(const LinkPtr& link, Stream& stream) {
  const uint32_t max_failures = host_.options().max_retries;
  uint32_t failures = 0;
  std::string why;
  for (;;) {
    bool progressed = false;
    try {
      Socket socket = host_.dial(link->peer, wire::ConnKind::kData, static_cast<uint8_t>(stream.index), &stream.dial_abort);
      // Acks have no deadline of their own: the core's watchdog judges progress.
      socket.set_timeouts(0, host_.options().timeout_s);
      socket.set_nodelay();
      if (auto_congestion_) choose_congestion_control(*link, stream, socket);
      {
        std::lock_guard<std::mutex> lock(link->mutex);
        stream.loss_based = socket.congestion_control() != "bbr";  // bbr does not back off on loss
      }
      progressed = run_session(*link, stream, socket);
    } catch (const std::exception& e) {
      why = e.what();
    }
    bool idle;  // nothing was lost: the receiver closed a connection that carried nothing
    {
      std::lock_guard<std::mutex> lock(link->mutex);
      idle = stream.inflight.empty() && link->queue.empty();
    }
    requeue_inflight(*link, stream, why);
    std::unique_lock<std::mutex> lock(link->mutex);
    if (link->stopping) return;
    if (idle) {  // dial again once there is something to send
      failures = 0;
      link->cv.wait(lock, [&] { return link->stopping || !link->queue.empty(); });
      if (link->stopping) return;
      continue;
    }
    failures = progressed ? 1 : failures + 1;
    if (failures > max_failures) {
      if (--link->live_streams == 0) {
        link->dead_reason = "all " + std::to_string(link->streams.size()) + " data connections to " +
                            link->peer.address + " failed; last error: " + why;
        lock.unlock();
        fail_queued(*link, link->dead_reason);
      }
      return;
    }
    // Back off before reconnecting: 50 ms, 100 ms, ... up to 1 s.
    const auto backoff = std::chrono::milliseconds(std::min<uint64_t>(1000, 50ull << std::min(failures - 1, 5u)));
    link->cv.wait_for(lock, backoff, [&] { return link->stopping; });
    if (link->stopping) return;
  }
}

bool TcpBackend::run_session(Link& link, Stream& stream, const Socket& socket) {
  std::atomic<bool> broken{false}, progressed{false};
  std::string reader_error, writer_error;
  {
    std::lock_guard<std::mutex> lock(link.mutex);
    if (link.stopping) return false;
    stream.socket = &socket;
  }
  std::thread reader([&] { read_acks(link, stream, socket, broken, progressed, reader_error); });
  try {
    warm_up(link, stream, socket, broken);
    std::vector<Outgoing> batch;
    for (;;) {
      uint64_t batch_bytes = 0;
      const uint64_t max_batch_bytes = batch_limit(link);
      {
        std::unique_lock<std::mutex> lock(link.mutex);
        link.cv.wait(lock, [&] {
          return link.stopping || broken || (!link.queue.empty() && stream.inflight_bytes < window_bytes_);
        });
        if (link.stopping || broken) break;
        // Small chunks go out several per syscall; a big one goes alone.
        while (!link.queue.empty() && stream.inflight_bytes < window_bytes_ && batch.size() < kMaxBatchChunks &&
               (batch.empty() || batch_bytes + link.queue.front().length <= max_batch_bytes)) {
          WriteChunk chunk = std::move(link.queue.front());
          link.queue.pop_front();
          if (chunk.transfer->finished()) continue;
          const uint64_t seq = stream.next_seq++;
          stream.inflight.emplace(seq, chunk);
          stream.inflight_bytes += chunk.length;
          batch_bytes += chunk.length;
          batch.push_back({std::move(chunk), seq});
        }
      }
      if (batch.empty()) continue;
      host_.pace(batch_bytes);
      observe_path(link);
      pace_to_path(link, batch_bytes, broken);
      send_chunks(socket, batch);
      batch.clear();  // its chunks hold their source regions
    }
  } catch (const std::exception& e) {
    writer_error = e.what();
  }
  broken = true;
  socket.shutdown();
  reader.join();
  bool stopping;
  {
    std::lock_guard<std::mutex> lock(link.mutex);
    stream.socket = nullptr;
    stopping = link.stopping;
  }
  if (stopping) return progressed;
  throw TransferError("data connection " + std::to_string(stream.index) + " to " + link.peer.address + " broke: " +
                      (reader_error.empty() ? writer_error : reader_error));
}

void TcpBackend::observe_path(Link& link) {
  uint32_t wanted = 0;
  {
    // One reader at a time, stamped after its reading: readings taken by two threads and
    // handed over in the other order would go back in time, and a counter that seems to
    // go back reads as a reconnect whose bytes then count twice.
    std::lock_guard<std::mutex> path_lock(link.path_mutex);
    if (now_ns() - link.last_path_sample_ns < kPathSampleIntervalNs) return;
    // Counters read apart would add up to rates the path never had.
    std::vector<std::pair<uint32_t, PathSample>> samples;
    uint64_t segments = 0, retransmits = 0;
    bool loss_based = false;
    {
      std::lock_guard<std::mutex> lock(link.mutex);  // keeps each live socket open
      for (const auto& stream : link.streams)
        if (stream->socket)
          if (const std::optional<PathSample> sample = read_path_sample(stream->socket->fd())) {
            samples.emplace_back(stream->index, *sample);
            if (auto_congestion_) switch_on_loss(link, *sample, *stream);
            segments += sample->segments_sent;
            retransmits += sample->retransmits;
            loss_based = loss_based || stream->loss_based;
          }
    }
    const int64_t now = now_ns();
    link.last_path_sample_ns = now;
    link.delivery.observe(samples, now);
    if (link.pacer)
      for (const auto& [index, sample] : samples) link.pacer->observe(index, sample, now);
    if (auto_streams_ && segments > 0)
      wanted = judge_streams(link, samples, static_cast<double>(retransmits) / static_cast<double>(segments),
                             loss_based);
  }
  if (wanted > 0) add_streams(link.peer.key, wanted);
}

uint32_t TcpBackend::judge_streams(Link& link, const std::vector<std::pair<uint32_t, PathSample>>& samples,
                                   double loss, bool loss_based) {
  double min_rtt_s = 0;
  for (const auto& [index, sample] : samples)
    if (sample.min_rtt_s > 0) min_rtt_s = min_rtt_s > 0 ? std::min(min_rtt_s, sample.min_rtt_s) : sample.min_rtt_s;
  const double seconds = link.delivery.seconds() - link.judged_seconds;
  if (min_rtt_s <= 0 || seconds < std::max(kJudgeMinS, kJudgeRtts * min_rtt_s)) return 0;
  StreamRule::Path path;
  path.min_rtt_s = min_rtt_s;
  path.rate_Bps = (link.delivery.bytes() - link.judged_bytes) / seconds;
  path.loss = loss;
  path.send_buffer_bytes = send_buffer_bytes_;
  path.loss_based = loss_based;
  link.judged_bytes = link.delivery.bytes();
  link.judged_seconds = link.delivery.seconds();
  return StreamRule::for_path(path);
}

// Where the kernel does not offer the chosen algorithm, the connection keeps the kernel's.
static const char* apply_congestion_control(const Socket& socket, const char* algorithm) {
  try {
    socket.set_congestion_control(algorithm);
    return algorithm;
  } catch (const std::invalid_argument&) {
    return nullptr;
  }
}

void TcpBackend::choose_congestion_control(Link& link, Stream& stream, const Socket& socket) {
  const std::optional<PathSample> sample = read_path_sample(socket.fd());
  const double rtt_s = sample ? sample->min_rtt_s : 0;
  std::lock_guard<std::mutex> lock(link.mutex);  // a switch on loss sees either none or the choice
  stream.handshake_rtt_s = rtt_s;
  stream.loss_count = {};
  stream.algorithm = apply_congestion_control(
      socket, link.lossy ? CongestionRule::kLossyPath : CongestionRule::after_handshake(rtt_s));
}

void TcpBackend::switch_on_loss(Link& link, const PathSample& sample, Stream& stream) {
  if (link.lossy || stream.algorithm == nullptr || std::strcmp(stream.algorithm, CongestionRule::kLossyPath) == 0)
    return;
  if (!stream.loss_count.observe(sample.srtt_s, sample.min_rtt_s, sample.past_slow_start, sample.segments_sent,
                                 sample.retransmits))
    return;
  link.lossy = true;
  for (const auto& other : link.streams)
    if (other->socket && other->algorithm != nullptr && std::strcmp(other->algorithm, CongestionRule::kLossyPath) != 0)
      if (const char* algorithm = apply_congestion_control(*other->socket, CongestionRule::kLossyPath)) {
        other->algorithm = algorithm;
        other->loss_based = false;
        ++link.congestion_switches;
      }
}

uint64_t TcpBackend::batch_limit(Link& link) {
  if (!link.pacer) return kMaxBatchBytes;
  std::lock_guard<std::mutex> lock(link.path_mutex);
  const double rate_Bps = link.pacer->rate_Bps();
  if (rate_Bps <= 0) return kMaxBatchBytes;
  // A paced batch leaves as one burst: keep it to about a millisecond of the rate, or a
  // slow link queues each burst for longer than the pacer's target.
  return std::clamp<uint64_t>(static_cast<uint64_t>(rate_Bps * kPacedBurstS), 1, kMaxBatchBytes);
}

void TcpBackend::pace_to_path(Link& link, uint64_t bytes, const std::atomic<bool>& broken) {
  if (!link.pacer) return;
  int64_t wait_ns;
  {
    std::lock_guard<std::mutex> lock(link.path_mutex);
    wait_ns = link.pacer->reserve(bytes, now_ns());
  }
  if (wait_ns <= 0) return;
  std::unique_lock<std::mutex> lock(link.mutex);
  link.cv.wait_for(lock, std::chrono::nanoseconds(wait_ns), [&] { return link.stopping || broken.load(); });
}

void TcpBackend::warm_up(Link& link, Stream& stream, const Socket& socket, const std::atomic<bool>& broken) {
  const std::optional<PathSample> first = read_path_sample(socket.fd());
  if (!first || !WarmupJudge::worth_warming(first->min_rtt_s)) return;
  static const std::vector<uint8_t> zeros(kWarmupFrameBytes, 0);
  static const uint32_t zeros_crc = crc32c(zeros.data(), zeros.size());
  bool loss_based;
  {
    std::lock_guard<std::mutex> lock(link.mutex);
    loss_based = stream.loss_based;
  }
  WarmupJudge judge(loss_based);
  uint64_t sent = 0;
  for (;;) {
    const std::optional<PathSample> sample = read_path_sample(socket.fd());
    if (!sample || judge.warm(*sample, now_ns(), sent)) return;
    // Padding past the congestion window would only wait in the send buffer, and real data
    // queued behind it: keep about a window of it unacknowledged.
    const uint64_t acked = sample->bytes_acked - first->bytes_acked;
    const bool window_full = sent > acked + sample->cwnd_bytes;
    wire::ChunkHeader header;
    {
      std::unique_lock<std::mutex> lock(link.mutex);
      const auto stop = [&] { return link.stopping || broken || !link.queue.empty(); };
      if (window_full) link.cv.wait_for(lock, std::chrono::milliseconds(1), stop);
      if (stop()) return;
      if (window_full) continue;
      header.seq = stream.next_seq++;  // never in flight: its ack settles nothing
    }
    header.flags = wire::ChunkHeader::kWarmup;
    header.length = kWarmupFrameBytes;
    header.payload_crc = zeros_crc;
    uint8_t head[wire::ChunkHeader::kSize];
    header.encode(head);
    iovec iov[2] = {{head, sizeof(head)}, {const_cast<uint8_t*>(zeros.data()), zeros.size()}};
    socket.sendv_all(iov, 2);
    sent += kWarmupFrameBytes;
    std::lock_guard<std::mutex> lock(link.mutex);
    link.warmup_bytes += kWarmupFrameBytes;
  }
}

void TcpBackend::send_chunks(const Socket& socket, const std::vector<Outgoing>& batch) {
  std::vector<std::array<uint8_t, wire::ChunkHeader::kSize>> headers(batch.size());
  std::vector<std::array<uint8_t, wire::ChunkHeader::kTrailerSize>> trailers(batch.size());
  std::vector<std::vector<uint8_t>> corrupted;
  corrupted.reserve(batch.size());
  std::vector<iovec> iov;
  iov.reserve(2 * batch.size() + 1);
  const auto flush = [&] {
    socket.sendv_all(iov.data(), static_cast<int>(iov.size()));
    iov.clear();
  };
  for (size_t i = 0; i < batch.size(); ++i) {
    const WriteChunk& chunk = batch[i].chunk;
    const uint8_t* payload = chunk.src->base + chunk.src_offset;
    const uint8_t* sent = payload;
    uint32_t pending = corrupt_next_.load();
    while (pending > 0 && !corrupt_next_.compare_exchange_weak(pending, pending - 1)) {
    }
    if (pending > 0) {  // test hook: flip one payload byte; the CRC is taken over the original
      corrupted.emplace_back(payload, payload + chunk.length);
      corrupted.back()[chunk.length / 2] ^= 0xFF;
      sent = corrupted.back().data();
    }
    wire::ChunkHeader header;
    header.seq = batch[i].seq;
    header.region_id = chunk.dst_region;
    header.offset = chunk.dst_offset;
    header.length = chunk.length;
    header.transfer_tag = chunk.transfer->tag;
    const bool trailer = chunk.length > kCrcPiece;
    if (trailer)
      header.flags = wire::ChunkHeader::kCrcTrailer;
    else
      header.payload_crc = crc32c(payload, chunk.length);
    header.encode(headers[i].data());
    iov.push_back({headers[i].data(), headers[i].size()});
    if (!trailer) {
      iov.push_back({const_cast<uint8_t*>(sent), chunk.length});
      continue;
    }
    // Each piece is checksummed right after the kernel copied it, while it is in cache: the
    // kernel's copy costs the same either way, a checksum first would pay the cold read.
    // The trailer leaves with the next chunk's header, or alone at the end of the batch.
    uint32_t crc = 0;
    for (uint64_t done = 0; done < chunk.length;) {
      const size_t n = std::min<uint64_t>(kCrcPiece, chunk.length - done);
      iov.push_back({const_cast<uint8_t*>(sent + done), n});
      flush();
      crc = crc32c(payload + done, n, crc);
      done += n;
    }
    wire::Writer(trailers[i].data()).put(crc);
    iov.push_back({trailers[i].data(), trailers[i].size()});
  }
  flush();
}

void TcpBackend::read_acks(Link& link, Stream& stream, const Socket& socket, std::atomic<bool>& broken,
                           std::atomic<bool>& progressed, std::string& error) {
  const uint32_t max_retries = host_.options().max_retries;
  // The receiver sends acks in bursts: take whatever arrived in one recv, settle the
  // whole burst under one lock.
  constexpr size_t kMaxAcks = 64;
  uint8_t buf[kMaxAcks * wire::Ack::kSize];
  size_t have = 0;
  std::vector<std::pair<wire::AckStatus, std::optional<WriteChunk>>> settled;
  try {
    for (;;) {
      have += socket.recv_some(buf + have, sizeof(buf) - have);
      observe_path(link);
      const size_t whole = have / wire::Ack::kSize;
      bool malformed = false;
      {
        std::lock_guard<std::mutex> lock(link.mutex);
        for (size_t i = 0; i < whole && !malformed; ++i) {
          wire::Ack ack;
          if (!ack.decode(buf + i * wire::Ack::kSize)) {
            malformed = true;
            break;
          }
          auto it = stream.inflight.find(ack.seq);
          if (it == stream.inflight.end()) {
            settled.emplace_back(ack.status, std::nullopt);
            continue;
          }
          stream.inflight_bytes -= it->second.length;
          settled.emplace_back(ack.status, std::move(it->second));
          stream.inflight.erase(it);
        }
      }
      std::memmove(buf, buf + whole * wire::Ack::kSize, have - whole * wire::Ack::kSize);
      have -= whole * wire::Ack::kSize;
      if (!settled.empty()) {
        link.cv.notify_all();
        progressed = true;
      }
      std::string closed_by_peer;
      for (auto& [status, known] : settled)
        if (!settle(link, status, known, max_retries)) closed_by_peer = wire::to_string(status);
      settled.clear();  // its chunks hold their source regions
      if (!closed_by_peer.empty()) throw TransferError("peer closed the connection: " + closed_by_peer);
      if (malformed) throw TransferError("malformed ack from peer");
    }
  } catch (const std::exception& e) {
    error = e.what();
  }
  broken = true;
  socket.shutdown();
  link.cv.notify_all();
}

bool TcpBackend::settle(Link& link, wire::AckStatus status, std::optional<WriteChunk>& chunk, uint32_t max_retries) {
  const std::string reason = wire::to_string(status);
  switch (status) {
    case wire::AckStatus::kOk:
      if (chunk) host_.chunk_applied(*chunk);
      break;
    case wire::AckStatus::kBadCrc:
      if (!chunk) break;
      ++chunk->attempts;
      host_.chunk_retried(*chunk, reason);
      if (chunk->attempts > max_retries) {
        host_.transfer_failed(chunk->transfer, "peer rejected a chunk " + std::to_string(chunk->attempts) +
                                                   " times: " + reason + " (" + describe(*chunk) + ")");
      } else {
        std::lock_guard<std::mutex> lock(link.mutex);
        link.queue.push_front(std::move(*chunk));
      }
      link.cv.notify_all();
      break;
    case wire::AckStatus::kUnknownRegion:
    case wire::AckStatus::kOutOfBounds:
    case wire::AckStatus::kNotATarget:
    case wire::AckStatus::kFenced:  // its transfer was cancelled here: already finished
      if (chunk) host_.transfer_failed(chunk->transfer, "peer rejected a chunk: " + reason + " (" + describe(*chunk) + ")");
      break;
    case wire::AckStatus::kBadHeader:
    case wire::AckStatus::kTooLarge:
      if (chunk) host_.transfer_failed(chunk->transfer, "peer rejected a chunk: " + reason + " (" + describe(*chunk) + ")");
      return false;
  }
  return true;
}

void TcpBackend::requeue_inflight(Link& link, Stream& stream, const std::string& why) {
  std::vector<WriteChunk> out_of_retries, retried;
  {
    std::lock_guard<std::mutex> lock(link.mutex);
    // Back in original order at the front, so the oldest chunks go out first.
    for (auto it = stream.inflight.rbegin(); it != stream.inflight.rend(); ++it) {
      WriteChunk& c = it->second;
      if (c.transfer->finished()) continue;
      if (++c.attempts > host_.options().max_retries) {
        out_of_retries.push_back(std::move(c));
      } else {
        retried.push_back(c);
        link.queue.push_front(std::move(c));
      }
    }
    stream.inflight.clear();
    stream.inflight_bytes = 0;
  }
  link.cv.notify_all();
  for (auto& c : retried) host_.chunk_retried(c, why);
  for (auto& c : out_of_retries)
    host_.transfer_failed(c.transfer, "chunk (" + describe(c) + ") not delivered after " + std::to_string(c.attempts) +
                                          " attempts; last error: " + why);
}

void TcpBackend::fail_queued(Link& link, const std::string& why) {
  std::deque<WriteChunk> queued;
  {
    std::lock_guard<std::mutex> lock(link.mutex);
    queued.swap(link.queue);
  }
  std::set<TransferState*> failed;
  for (auto& c : queued)
    if (failed.insert(c.transfer.get()).second) host_.transfer_failed(c.transfer, why);
}

void TcpBackend::stop_link(const LinkPtr& link) {
  {
    std::lock_guard<std::mutex> lock(link->mutex);
    link->stopping = true;
    for (auto& stream : link->streams) {
      if (stream->socket) stream->socket->shutdown();
      stream->dial_abort.abort();  // a dial waiting on a silent peer would hold the join for timeout_s
    }
  }
  link->cv.notify_all();
  for (auto& stream : link->streams) stream->thread.join();
  fail_queued(*link, "peer disconnected");
}

void TcpBackend::disconnect(uint64_t peer_key) {
  if (LinkPtr link = take_peer_link(mutex_, links_, peer_key)) stop_link(link);
}

void TcpBackend::close() {
  std::map<uint64_t, LinkPtr> links;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closed_ = true;
    links.swap(links_);
  }
  for (auto& [key, link] : links) stop_link(link);
}

void TcpBackend::debug_kill_stream(uint64_t peer_key, uint32_t stream) {
  LinkPtr link = find_link(peer_key);
  if (!link) throw std::invalid_argument("no such data stream");
  std::lock_guard<std::mutex> lock(link->mutex);  // streams="auto" may be adding streams
  if (stream >= link->streams.size()) throw std::invalid_argument("no such data stream");
  if (link->streams[stream]->socket) link->streams[stream]->socket->shutdown();
}

void TcpBackend::debug_corrupt_chunks(uint32_t n) { corrupt_next_ = n; }

void TcpBackend::add_peer_stats(uint64_t peer_key, std::map<std::string, double>& stats) {
  LinkPtr link = find_link(peer_key);
  if (!link) return;
  {
    // The window the kernel gave this peer's live data connections right now, and their
    // retransmits: what the path let the engine keep in flight.
    std::lock_guard<std::mutex> lock(link->mutex);  // keeps each live socket open
    for (const auto& stream : link->streams)
      if (stream->socket)
        if (const std::optional<PathSample> sample = read_path_sample(stream->socket->fd())) {
          stats["cwnd_bytes"] += static_cast<double>(sample->cwnd_bytes);
          stats["tcp_retransmits"] += static_cast<double>(sample->retransmits);
          stats["live_streams"] += 1;
          // Read back from the socket: what runs, whoever chose it.
          stats["congestion_control:" + stream->socket->congestion_control()] += 1;
          if (auto_congestion_) {  // the lowest: a handshake that lost a packet may read high
            double& rtt_s = stats["handshake_rtt_s"];
            rtt_s = rtt_s > 0 ? std::min(rtt_s, stream->handshake_rtt_s) : stream->handshake_rtt_s;
          }
        }
    if (auto_congestion_) stats["congestion_switches"] += link->congestion_switches;
    stats["streams"] += static_cast<double>(link->streams.size());
    stats["warmup_bytes"] += static_cast<double>(link->warmup_bytes);
  }
  std::lock_guard<std::mutex> lock(link->path_mutex);
  stats["path_limited_bytes"] += link->delivery.bytes();
  stats["path_limited_seconds"] += link->delivery.seconds();
  if (!link->pacer) return;
  stats["paced_bps"] = std::max(stats["paced_bps"], 8 * link->pacer->rate_Bps());
  stats["link_rate_bps"] = std::max(stats["link_rate_bps"], 8 * link->pacer->link_rate_Bps());
  stats["queue_delay_s"] = std::max(stats["queue_delay_s"], link->pacer->queue_delay_s());
}

// ---- receiver --------------------------------------------------------------

void TcpBackend::serve(const Socket& socket, const PeerInfo& from) {
  const double idle_limit_s = host_.options().idle_timeout_s;
  // Wake at least every timeout_s to check the idle limit (and at the limit, if shorter).
  const double wake_s = std::min(host_.options().timeout_s, idle_limit_s);
  socket.set_timeouts(wake_s, host_.options().timeout_s);
  std::vector<uint8_t> scratch;
  AckBatch acks(socket);
  uint8_t header_bytes[wire::ChunkHeader::kSize];
  size_t prefetched = 0;  // bytes of the next header that arrived with the last payload
  double idle_s = 0;  // since the last frame, counted in receive timeouts (no clock read per chunk)
  for (;;) {
    if (prefetched > 0) {
      socket.recv_all(header_bytes + prefetched, sizeof(header_bytes) - prefetched);
      prefetched = 0;
    } else if (acks.empty() || !socket.poll_frame(header_bytes, sizeof(header_bytes))) {
      acks.flush();  // nothing more queued: the sender is waiting for these
      if (!socket.recv_frame(header_bytes, sizeof(header_bytes))) {
        idle_s += wake_s;
        if (idle_s >= idle_limit_s) {
          host_.connection_idled();
          return;  // idle too long: closed; the sender dials again when it has work
        }
        continue;
      }
    }
    idle_s = 0;
    wire::ChunkHeader header;
    wire::AckStatus status = header.decode(header_bytes);
    if (status != wire::AckStatus::kOk) {
      // The stream cannot be resynchronised: say why and close it.
      host_.chunk_received(0, status);
      acks.add(status, header.seq, 0);
      acks.flush();
      return;
    }
    if (header.flags & wire::ChunkHeader::kWarmup) {  // padding: checked, dropped, acked
      scratch.resize(kCrcPiece);
      uint32_t crc = 0;
      for (uint64_t left = header.length; left > 0;) {
        const size_t n = std::min<uint64_t>(left, scratch.size());
        socket.recv_all(scratch.data(), n);
        crc = crc32c(scratch.data(), n, crc);
        left -= n;
      }
      acks.add(crc == header.payload_crc ? wire::AckStatus::kOk : wire::AckStatus::kBadCrc, header.seq, header.length);
      continue;
    }
    RegionPtr region = host_.find_region(header.region_id);
    if (!region || region->on_device)  // GPU memory is no destination for the CPU's recv
      status = wire::AckStatus::kUnknownRegion;
    else if (!region->target)
      status = wire::AckStatus::kNotATarget;
    else if (header.offset > region->size || header.length > region->size - header.offset)
      status = wire::AckStatus::kOutOfBounds;
    else if (!host_.begin_receive(from.engine_id, header.transfer_tag))
      status = wire::AckStatus::kFenced;
    const bool trailer = (header.flags & wire::ChunkHeader::kCrcTrailer) != 0;
    if (status != wire::AckStatus::kOk) {
      region.reset();
      scratch.resize(std::min<size_t>(header.length + wire::ChunkHeader::kTrailerSize, kCrcPiece));
      for (uint64_t left = header.length + (trailer ? wire::ChunkHeader::kTrailerSize : 0); left > 0;) {
        const size_t n = std::min<uint64_t>(left, scratch.size());
        socket.recv_all(scratch.data(), n);
        left -= n;
      }
    } else {
      // Straight into the destination; a chunk becomes visible as "applied" only through
      // its ack after the CRC matched, and a transfer only once every chunk was acked.
      const ReceiveGuard fence_hold(host_, from.engine_id, header.transfer_tag);
      uint8_t* dst = region->base + header.offset;
      const size_t trailer_size = trailer ? wire::ChunkHeader::kTrailerSize : 0;
      uint8_t after[wire::ChunkHeader::kTrailerSize + wire::ChunkHeader::kSize];  // trailer, next header
      size_t after_got = 0;
      uint32_t crc = 0;
      for (uint64_t done = 0; done < header.length;) {
        // Whatever has arrived (up to a piece): the CRC follows each copy while it is hot.
        // The last piece also takes the trailer and the start of the next header: one
        // syscall per small chunk, not three.
        const size_t want = std::min<uint64_t>(kCrcPiece, header.length - done);
        iovec iov[2] = {{dst + done, want}, {after, trailer_size + wire::ChunkHeader::kSize}};
        const size_t got = socket.recvv_some(iov, want == header.length - done ? 2 : 1);
        const size_t n = std::min(got, want);
        crc = crc32c(dst + done, n, crc);
        done += n;
        after_got = got - n;
      }
      region.reset();
      if (after_got < trailer_size) {
        socket.recv_all(after + after_got, trailer_size - after_got);
        after_got = trailer_size;
      }
      const uint32_t expected = trailer ? wire::Reader(after).get<uint32_t>() : header.payload_crc;
      prefetched = after_got - trailer_size;
      std::memcpy(header_bytes, after + trailer_size, prefetched);
      if (crc != expected) status = wire::AckStatus::kBadCrc;
    }
    host_.chunk_received(header.length, status);
    acks.add(status, header.seq, header.length);
  }
}

}  // namespace pddcore::transfer::tcp
