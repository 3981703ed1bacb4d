// Framework-free description of an engine's paged KV pool and of the copy plan that
// packs a selection of its pages into one contiguous buffer.
//
// A layout is a list of planes (per layer: K and V for MHA/GQA, one latent plane for
// MLA). Plane p holds `num_pages` pages, page i starting at base + i * page_stride;
// one page is `tokens_per_page` rows of `num_heads * head_bytes` contiguous bytes.
//
// Packed byte order is layer-major: for each selected layer, for each of its planes,
// for each page id in the order given, the page's bytes (or, with a head range, the
// selected heads of every token of that page, token after token).
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace pddcore {

struct PlaneDesc {
  uint64_t base = 0;           // address of page 0 (host or device)
  uint64_t num_pages = 0;
  uint64_t page_stride = 0;    // bytes between page i and page i+1 (>= page_bytes)
  uint64_t tokens_per_page = 1;
  uint64_t num_heads = 1;
  uint64_t head_bytes = 0;     // bytes of one head of one token

  uint64_t row_bytes() const { return num_heads * head_bytes; }
  uint64_t page_bytes() const { return tokens_per_page * row_bytes(); }
};

// Half-open KV-head range [begin, end); end == 0 means "all heads".
struct HeadRange {
  uint64_t begin = 0;
  uint64_t end = 0;
};

// One strided copy: `rows` rows of `row_bytes`, the i-th from packed offset
// `packed_offset + i * row_bytes` to/from pool address `pool_addr + i * pool_stride`.
struct CopyItem {
  uint64_t pool_addr;
  uint64_t packed_offset;
  uint64_t rows;
  uint64_t row_bytes;
  uint64_t pool_stride;

  uint64_t nbytes() const { return rows * row_bytes; }
};

class KVLayoutDesc {
 public:
  KVLayoutDesc(std::vector<PlaneDesc> planes, uint32_t planes_per_layer)
      : planes_(std::move(planes)), planes_per_layer_(planes_per_layer) {
    if (planes_per_layer_ == 0) throw std::invalid_argument("planes_per_layer must be >= 1");
    if (planes_.empty() || planes_.size() % planes_per_layer_ != 0)
      throw std::invalid_argument("number of planes (" + std::to_string(planes_.size()) +
                                  ") is not a positive multiple of planes_per_layer (" +
                                  std::to_string(planes_per_layer_) + ")");
    for (size_t i = 0; i < planes_.size(); ++i) {
      const PlaneDesc& p = planes_[i];
      const std::string where = "plane " + std::to_string(i) + ": ";
      if (p.head_bytes == 0 || p.num_heads == 0 || p.tokens_per_page == 0)
        throw std::invalid_argument(where + "page geometry has a zero dimension");
      if (p.page_stride < p.page_bytes())
        throw std::invalid_argument(where + "pages are not contiguous (page_stride " +
                                    std::to_string(p.page_stride) + " < page_bytes " +
                                    std::to_string(p.page_bytes()) + ")");
      if (p.base == 0 && p.num_pages > 0) throw std::invalid_argument(where + "null base pointer");
    }
  }

  uint32_t num_layers() const { return static_cast<uint32_t>(planes_.size() / planes_per_layer_); }
  uint32_t planes_per_layer() const { return planes_per_layer_; }
  const std::vector<PlaneDesc>& planes() const { return planes_; }
  const PlaneDesc& plane(uint32_t layer, uint32_t k) const { return planes_[layer * planes_per_layer_ + k]; }

  // Resolves a head range against plane p, throwing if it does not fit.
  HeadRange resolve_heads(const PlaneDesc& p, HeadRange heads) const {
    if (heads.end == 0 && heads.begin == 0) return {0, p.num_heads};
    if (heads.begin >= heads.end || heads.end > p.num_heads)
      throw std::invalid_argument("head range (" + std::to_string(heads.begin) + ", " +
                                  std::to_string(heads.end) + ") is out of bounds for a plane with " +
                                  std::to_string(p.num_heads) + " KV heads");
    return heads;
  }

  std::vector<uint32_t> resolve_layers(const std::vector<int64_t>& layers) const {
    std::vector<uint32_t> out;
    if (layers.empty()) {
      for (uint32_t l = 0; l < num_layers(); ++l) out.push_back(l);
      return out;
    }
    for (int64_t l : layers) {
      if (l < 0 || l >= static_cast<int64_t>(num_layers()))
        throw std::invalid_argument("layer " + std::to_string(l) + " is out of range [0, " +
                                    std::to_string(num_layers()) + ")");
      out.push_back(static_cast<uint32_t>(l));
    }
    return out;
  }

  uint64_t packed_nbytes(uint64_t num_page_ids, const std::vector<int64_t>& layers, HeadRange heads) const {
    uint64_t total = 0;
    for (uint32_t l : resolve_layers(layers))
      for (uint32_t k = 0; k < planes_per_layer_; ++k) {
        const PlaneDesc& p = plane(l, k);
        HeadRange h = resolve_heads(p, heads);
        total += num_page_ids * p.tokens_per_page * (h.end - h.begin) * p.head_bytes;
      }
    return total;
  }

  // Checks every page id against every selected plane; throws naming the first bad one.
  template <typename Id>
  void check_page_ids(const Id* ids, size_t n, const std::vector<uint32_t>& layers) const {
    uint64_t limit = UINT64_MAX;
    for (uint32_t l : layers)
      for (uint32_t k = 0; k < planes_per_layer_; ++k) limit = std::min(limit, plane(l, k).num_pages);
    for (size_t i = 0; i < n; ++i) {
      const int64_t id = static_cast<int64_t>(ids[i]);
      if (id < 0 || static_cast<uint64_t>(id) >= limit)
        throw std::invalid_argument("page id " + std::to_string(id) + " at position " + std::to_string(i) +
                                    " is out of range [0, " + std::to_string(limit) + ")");
    }
  }

  // Builds the copy plan. Runs of consecutive page ids become one item: a single
  // contiguous copy when whole, densely strided pages move, else one row per token.
  template <typename Id>
  std::vector<CopyItem> plan(const Id* ids, size_t n, const std::vector<int64_t>& layer_sel,
                             HeadRange head_sel) const {
    const std::vector<uint32_t> layers = resolve_layers(layer_sel);
    check_page_ids(ids, n, layers);
    std::vector<CopyItem> items;
    uint64_t offset = 0;
    for (uint32_t l : layers) {
      for (uint32_t k = 0; k < planes_per_layer_; ++k) {
        const PlaneDesc& p = plane(l, k);
        const HeadRange h = resolve_heads(p, head_sel);
        const bool whole_rows = h.begin == 0 && h.end == p.num_heads;
        const uint64_t slice_row = (h.end - h.begin) * p.head_bytes;
        const uint64_t slice_page = p.tokens_per_page * slice_row;
        size_t i = 0;
        while (i < n) {
          size_t run = 1;
          while (i + run < n && static_cast<int64_t>(ids[i + run]) == static_cast<int64_t>(ids[i]) + static_cast<int64_t>(run))
            ++run;
          const uint64_t addr = p.base + static_cast<uint64_t>(ids[i]) * p.page_stride + h.begin * p.head_bytes;
          if (whole_rows && p.page_stride == p.page_bytes()) {
            items.push_back({addr, offset, 1, run * slice_page, 0});
          } else if (whole_rows) {
            items.push_back({addr, offset, run, slice_page, p.page_stride});
          } else if (p.page_stride == p.page_bytes()) {
            items.push_back({addr, offset, run * p.tokens_per_page, slice_row, p.row_bytes()});
          } else {
            for (size_t r = 0; r < run; ++r)
              items.push_back({addr + r * p.page_stride, offset + r * slice_page, p.tokens_per_page, slice_row,
                               p.row_bytes()});
          }
          offset += run * slice_page;
          i += run;
        }
      }
    }
    return items;
  }

 private:
  std::vector<PlaneDesc> planes_;
  uint32_t planes_per_layer_;
};

}  // namespace pddcore
