// Engine: transfer bookkeeping. A write_batch becomes chunks handed to the peer's backend;
// each applied chunk counts once; the last one completes the transfer (and only then is its
// notification sent); cancel fences the receiver so nothing lands after it returns.
#include <algorithm>
#include <stdexcept>

#include "engine.h"

namespace pddcore::transfer {

TransferPtr Engine::write_batch(const PeerPtr& peer, const std::vector<WriteOp>& ops,
                                std::optional<std::string> notify) {
  if (closing_) throw TransferError("engine is closed");
  if (ops.empty()) throw std::invalid_argument("write_batch needs at least one write");
  if (notify && notify->size() > wire::kMaxControlBytes) throw std::invalid_argument("notify payload too large");
  if (!peer->alive) throw TransferError("peer " + peer->info.address + " is disconnected: " + peer->lost_reason);
  std::vector<WriteChunk> chunks;
  std::vector<uint64_t> sources;
  std::vector<DestinationRange> destinations;
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
    destinations.push_back({op.dst_region, op.dst_offset, op.nbytes});
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
    for (const DestinationRange& range : destinations) check_not_quarantined(peer->info.key, range);
    const uint64_t id = next_transfer_id_++;
    transfer = std::make_shared<TransferState>(id, tags_.tag(static_cast<uint32_t>(id)), peer->info.key, total,
                                               std::move(destinations));
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

void Engine::check_not_quarantined(uint64_t peer_key, const DestinationRange& range) const {
  for (const auto& [id, quarantined] : quarantined_) {
    if (quarantined->peer_key != peer_key) continue;
    for (const DestinationRange& held : quarantined->destinations)
      if (held.region == range.region && held.offset < range.offset + range.nbytes &&
          range.offset < held.offset + held.nbytes)
        throw TransferError("destination region " + std::to_string(range.region) + " [" +
                            std::to_string(range.offset) + ", +" + std::to_string(range.nbytes) +
                            ") is quarantined: bytes of cancelled transfer " + std::to_string(id) +
                            " may still land there until a cancel() of it is confirmed");
  }
}

void Engine::cancel(const TransferPtr& transfer) {
  const PeerPtr peer = find_peer(transfer->peer_key);
  {
    std::lock_guard<std::mutex> lock(transfers_mutex_);
    quarantined_.emplace(transfer->id, transfer);
  }
  finish_transfer(transfer, TransferStatus::kCancelled, "cancelled");
  // A failed transfer is fenced too: its chunks on the wire must not land in a reused range.
  if (transfer->status() != TransferStatus::kDone && !peer)
    throw TransferError("transfer cancelled, but its peer is disconnected, so no fence can be confirmed: its "
                        "destination ranges stay quarantined");
  const int64_t deadline = now_ns() + static_cast<int64_t>(options_.timeout_s * 1e9);
  if (transfer->status() != TransferStatus::kDone) {
    peer->backend->drain(*transfer, deadline);
    if (!fence(*peer, *transfer, deadline))
      throw TransferError("transfer cancelled, but " + peer->info.address +
                          " did not confirm that none of its chunks is being written: bytes already sent may "
                          "still land, so its destination ranges stay quarantined until a cancel() is confirmed");
  }
  std::lock_guard<std::mutex> lock(transfers_mutex_);
  quarantined_.erase(transfer->id);
}

bool Engine::fence(Peer& peer, const TransferState& transfer, int64_t deadline_ns) {
  std::string payload(sizeof(transfer.tag), '\0');
  wire::Writer(reinterpret_cast<uint8_t*>(payload.data())).put(transfer.tag);
  // The peer answers busy after its own timeout_s while a chunk is still being written; a
  // fence is never lifted, so asking again until it is quiet (or our deadline) is safe.
  while (now_ns() < deadline_ns) {
    {
      std::lock_guard<std::mutex> lock(peer.reply_mutex);
      peer.fence_replies.erase(transfer.tag);
    }
    send_control(peer, wire::ControlType::kFence, payload);
    std::unique_lock<std::mutex> lock(peer.reply_mutex);
    peer.reply_cv.wait_until(lock, std::chrono::steady_clock::now() + std::chrono::nanoseconds(deadline_ns - now_ns()),
                             [&] { return peer.fence_replies.count(transfer.tag) || !peer.alive; });
    const auto reply = peer.fence_replies.find(transfer.tag);
    if (reply == peer.fence_replies.end()) return false;
    const bool confirmed = reply->second;
    peer.fence_replies.erase(reply);
    if (confirmed) return true;
  }
  return false;
}

bool Engine::begin_receive(uint64_t sender_engine_id, uint32_t transfer_tag) {
  return fences_.begin(sender_engine_id, transfer_tag);
}

void Engine::end_receive(uint64_t sender_engine_id, uint32_t transfer_tag) { fences_.end(sender_engine_id, transfer_tag); }

void Engine::chunk_received(uint64_t bytes, wire::AckStatus status) {
  if (status == wire::AckStatus::kOk) {
    bytes_received_ += bytes;
    ++chunks_received_;
  } else {
    ++chunks_rejected_;
  }
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

}  // namespace pddcore::transfer
