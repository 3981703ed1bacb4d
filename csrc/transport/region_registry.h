// The engine's registered memory regions: ids handed out once, lookups for every chunk,
// and the listing of write targets a peer may query.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "pddcore/transfer_backend.h"

namespace pddcore::transfer {

class RegionRegistry {
 public:
  // Gives the range a new id and records it; `enroll` (the backends' registration) runs
  // first, under the registry's lock, so a region is never visible half-registered.
  template <class Enroll>
  RegionPtr add(uint8_t* base, uint64_t size, bool on_device, bool target, bool listed_address, Enroll&& enroll) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto region = std::make_shared<const Region>(Region{next_id_++, base, size, on_device, target, listed_address});
    enroll(region);
    regions_.emplace(region->id, region);
    return region;
  }
  // Removes a region and returns it (the caller waits for its other holders); `withdraw`
  // (the backends' deregistration) runs under the lock. Throws std::invalid_argument for
  // an unknown id.
  template <class Withdraw>
  RegionPtr remove(uint64_t region_id, Withdraw&& withdraw) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = regions_.find(region_id);
    if (it == regions_.end()) throw std::invalid_argument("region " + std::to_string(region_id) + " is not registered");
    RegionPtr region = std::move(it->second);
    regions_.erase(it);
    withdraw(region_id);
    return region;
  }
  // Null when no region has this id.
  RegionPtr find(uint64_t region_id) const;
  // The body of a kRegionList reply: one wire::RegionEntry per write target.
  std::string target_listing() const;

 private:
  mutable std::mutex mutex_;
  std::unordered_map<uint64_t, RegionPtr> regions_;
  uint64_t next_id_ = 1;
};

}  // namespace pddcore::transfer
