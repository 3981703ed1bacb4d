#include "region_registry.h"

namespace pddcore::transfer {

RegionPtr RegionRegistry::find(uint64_t region_id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = regions_.find(region_id);
  return it == regions_.end() ? nullptr : it->second;
}

std::string RegionRegistry::target_listing() const {
  std::string listing;
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [id, region] : regions_) {
    if (!region->target) continue;
    uint8_t entry[wire::RegionEntry::kSize];
    const uint64_t address = region->listed_address ? reinterpret_cast<uint64_t>(region->base) : 0;
    wire::Writer(entry).put(id).put(address).put(region->size);
    listing.append(reinterpret_cast<const char*>(entry), sizeof(entry));
  }
  return listing;
}

}  // namespace pddcore::transfer
