// Engine: the watchdog. Every tick it fails transfers that made no progress for timeout_s
// (a dead or unreachable peer); every second it pings each peer, which keeps its RTT
// estimate fresh and finds a lost control connection.
#include <chrono>

#include "engine.h"

namespace pddcore::transfer {

namespace {

constexpr int64_t kPingIntervalNs = 1'000'000'000;
constexpr auto kWatchdogTick = std::chrono::milliseconds(50);

}  // namespace

void Engine::watchdog_loop() {
  int64_t next_ping = now_ns() + kPingIntervalNs;
  std::unique_lock<std::mutex> lock(watchdog_mutex_);
  while (!watchdog_wake_.wait_for(lock, kWatchdogTick, [this] { return closing_.load(); })) {
    lock.unlock();
    const int64_t now = now_ns();
    fail_stalled_transfers(now);
    if (now >= next_ping) {
      next_ping = now + kPingIntervalNs;
      ping_peers();
    }
    lock.lock();
  }
}

void Engine::fail_stalled_transfers(int64_t now) {
  const int64_t timeout_ns = static_cast<int64_t>(options_.timeout_s * 1e9);
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
}

void Engine::ping_peers() {
  std::vector<PeerPtr> peers;
  {
    std::lock_guard<std::mutex> guard(peers_mutex_);
    for (auto& [key, peer] : peers_)
      if (peer->alive) peers.push_back(peer);
  }
  for (auto& peer : peers) {
    try {
      send_ping(*peer);
    } catch (const std::exception&) {
      // A lost control connection shows in the peer's stats and in its transfers.
    }
  }
}

}  // namespace pddcore::transfer
