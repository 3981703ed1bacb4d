// Engine: the numbers stats() reports (engine totals and per peer) and the test hooks.
#include <algorithm>

#include "engine.h"

namespace pddcore::transfer {

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
          {"accept_stalls", double(server_->accept_stalls())},
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
