// Lookup and removal of a backend's per-peer links (keyed by the core's peer handle),
// under the mutex that guards the map.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace pddcore::transfer {

// The link of a peer, or null.
template <class Link>
std::shared_ptr<Link> find_peer_link(std::mutex& mutex, const std::map<uint64_t, std::shared_ptr<Link>>& links,
                                     uint64_t peer_key) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = links.find(peer_key);
  return it == links.end() ? nullptr : it->second;
}

// Removes the link of a peer and hands it to the caller to stop (null if none).
template <class Link>
std::shared_ptr<Link> take_peer_link(std::mutex& mutex, std::map<uint64_t, std::shared_ptr<Link>>& links,
                                     uint64_t peer_key) {
  std::lock_guard<std::mutex> lock(mutex);
  auto it = links.find(peer_key);
  if (it == links.end()) return nullptr;
  std::shared_ptr<Link> link = std::move(it->second);
  links.erase(it);
  return link;
}

}  // namespace pddcore::transfer
