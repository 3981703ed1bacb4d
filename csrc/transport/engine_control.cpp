// Engine: the control protocol. Each peer has one control connection that we dialled
// (we send messages, notifications, pings, fences and region queries; read_control_replies
// takes the answers) and serves the one it dialled to us (serve_control).
#include <cstring>

#include "control_frames.h"
#include "engine.h"

namespace pddcore::transfer {

void Engine::serve_control(const Socket& s, const std::string& from, uint64_t from_engine_id) {
  std::string body;
  while (!closing_) {
    wire::ControlType type;
    if (!recv_control_frame(s, &type, &body, /*idle_ok=*/true)) continue;
    wire::ControlType reply_type;
    std::string reply_body;
    switch (type) {
      case wire::ControlType::kMessage:
      case wire::ControlType::kNotify:
        if (!inbox_.push({from, from_engine_id, std::move(body), type == wire::ControlType::kNotify})) return;
        ++messages_received_;
        continue;
      case wire::ControlType::kPing:
        reply_type = wire::ControlType::kPong;
        reply_body = std::move(body);
        break;
      case wire::ControlType::kFence:
        if (body.size() != sizeof(uint32_t)) throw TransferError("malformed fence");
        reply_type = fences_.install(from_engine_id,
                                     wire::Reader(reinterpret_cast<const uint8_t*>(body.data())).get<uint32_t>(),
                                     options_.timeout_s)
                         ? wire::ControlType::kFenceAck
                         : wire::ControlType::kFenceBusy;
        reply_body = std::move(body);
        break;
      case wire::ControlType::kRegionQuery:
        reply_type = wire::ControlType::kRegionList;
        reply_body = regions_.target_listing();
        break;
      default:
        throw TransferError("unexpected control frame");
    }
    send_control_frame(s, reply_type, reply_body);
  }
}

void Engine::read_control_replies(const PeerPtr& peer) {
  std::string why = "engine closed";
  try {
    std::string payload;
    for (;;) {
      wire::ControlType type;
      recv_control_frame(peer->control, &type, &payload);
      const auto* bytes = reinterpret_cast<const uint8_t*>(payload.data());
      if (type == wire::ControlType::kPong && payload.size() == sizeof(int64_t)) {
        int64_t sent;
        std::memcpy(&sent, bytes, sizeof(sent));
        const int64_t sample = now_ns() - sent, old = peer->rtt_ns.load();
        peer->rtt_ns = old == 0 ? sample : (old * 7 + sample) / 8;
      } else if (type == wire::ControlType::kRegionList) {
        std::lock_guard<std::mutex> lock(peer->reply_mutex);
        peer->region_list.clear();
        wire::Reader r(bytes);
        for (size_t i = 0; i < payload.size() / wire::RegionEntry::kSize; ++i) {
          wire::RegionEntry e;
          e.region_id = r.get<uint64_t>();
          e.base_address = r.get<uint64_t>();
          e.size = r.get<uint64_t>();
          peer->region_list.push_back(e);
        }
        ++peer->region_lists_received;
        peer->reply_cv.notify_all();
      } else if ((type == wire::ControlType::kFenceAck || type == wire::ControlType::kFenceBusy) &&
                 payload.size() == sizeof(uint32_t)) {
        std::lock_guard<std::mutex> lock(peer->reply_mutex);
        peer->fence_replies[wire::Reader(bytes).get<uint32_t>()] = type == wire::ControlType::kFenceAck;
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
  std::lock_guard<std::mutex> lock(peer.send_mutex);
  if (!peer.alive) throw TransferError("control connection to " + peer.info.address + " lost: " + peer.lost_reason);
  try {
    send_control_frame(peer.control, type, payload);
  } catch (const TransferError& e) {
    peer.alive = false;
    peer.lost_reason = e.what();
    peer.control.shutdown();
    throw TransferError("control connection to " + peer.info.address + " lost: " + e.what());
  }
}

void Engine::send_ping(Peer& peer) {
  const int64_t sent = now_ns();
  send_control(peer, wire::ControlType::kPing, std::string(reinterpret_cast<const char*>(&sent), sizeof(sent)));
}

void Engine::send(const PeerPtr& peer, const std::string& message) {
  send_control(*peer, wire::ControlType::kMessage, message);
  ++messages_sent_;
}

std::vector<InboxEntry> Engine::poll_messages(double timeout_s) { return inbox_.poll(timeout_s); }

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

}  // namespace pddcore::transfer
