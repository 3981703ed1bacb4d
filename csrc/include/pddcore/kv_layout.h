// Framework-free description of an engine's paged KV pool and of the copy plan that
// packs a selection of its pages into one contiguous buffer.
//
// A layout is a list of planes (per layer: K and V for MHA/GQA, one latent plane for
// MLA). Plane p holds `num_pages` pages; page i starts at base + i * page_stride. A page
// is a grid of `tokens_per_page` x `num_heads` cells of `head_bytes` contiguous bytes,
// cell (t, h) at page + t * token_stride + h * head_stride. Dense pages (token-major,
// heads adjacent) are the common case; the strides also describe head-major pages and
// vLLM's pages whose K and V halves alternate within each (token, head) row.
//
// Packed byte order is canonical whatever the pool's strides, so pools of different
// layouts exchange pages: for each selected layer, for each of its planes, for each page
// id in the order given, token after token, the selected heads' cells.
//
// Pool order (plan_pool_order) is for pools that share a page format (pool_page_format):
// for each selected layer, for each span its pages' cells tile (one span holding K and V
// where they alternate within a page, as in vLLM 0.33's rows; else one per plane), for
// each page id, the span's bytes as they lie in the pool: one copy per run of consecutive
// page ids instead of one per cell.
#pragma once

#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace pddcore {

struct PlaneDesc {
  uint64_t base = 0;           // address of page 0 (host or device)
  uint64_t num_pages = 0;
  uint64_t page_stride = 0;    // bytes between page i and page i+1
  uint64_t tokens_per_page = 1;
  uint64_t num_heads = 1;
  uint64_t head_bytes = 0;     // bytes of one head of one token (one cell)
  uint64_t token_stride = 0;   // bytes between token t and t+1 within a page
  uint64_t head_stride = 0;    // bytes between head h and h+1 within a token

  uint64_t row_bytes() const { return num_heads * head_bytes; }
  uint64_t page_bytes() const { return tokens_per_page * row_bytes(); }
  bool heads_adjacent() const { return num_heads == 1 || head_stride == head_bytes; }
  bool dense_page() const { return heads_adjacent() && (tokens_per_page == 1 || token_stride == row_bytes()); }
  // (token, head) cells evenly spaced in token-major order: one strided run covers a page.
  bool cells_uniform() const { return tokens_per_page == 1 || token_stride == num_heads * head_stride; }
};

// Half-open KV-head range [begin, end); end == 0 means "all heads".
struct HeadRange {
  uint64_t begin = 0;
  uint64_t end = 0;
};

// One strided copy: `rows` rows of `row_bytes`, the i-th between packed offset
// `packed_offset + i * packed_stride` and pool address `pool_addr + i * pool_stride`.
struct CopyItem {
  uint64_t pool_addr;
  uint64_t packed_offset;
  uint64_t rows;
  uint64_t row_bytes;
  uint64_t pool_stride;
  uint64_t packed_stride;

  uint64_t nbytes() const { return rows * row_bytes; }
};

// Where one plane's cells sit in a pool-order span: what two pools must agree on to
// exchange pages in pool order (compared field by field).
struct SpanPlane {
  uint32_t layer, plane;
  uint64_t offset;  // of the plane's page start within the span
  uint64_t tokens_per_page, num_heads, head_bytes, token_stride, head_stride;
  bool operator==(const SpanPlane& o) const {
    return layer == o.layer && plane == o.plane && offset == o.offset && tokens_per_page == o.tokens_per_page &&
           num_heads == o.num_heads && head_bytes == o.head_bytes && token_stride == o.token_stride &&
           head_stride == o.head_stride;
  }
};

// One page's span of a layer in pool order: page i's starts at `start + i * page_stride`.
struct PageSpan {
  uint64_t start, bytes, page_stride;
  std::vector<SpanPlane> planes;
};

namespace detail {

// True when no two cells of a plane overlap: with its strided dimensions sorted by
// stride, each stride clears everything the smaller ones span.
inline bool cells_disjoint(const PlaneDesc& p) {
  struct Dim {
    uint64_t stride, count;
  };
  Dim dims[3] = {{p.head_stride, p.num_heads}, {p.token_stride, p.tokens_per_page}, {p.page_stride, p.num_pages}};
  std::sort(std::begin(dims), std::end(dims), [](const Dim& a, const Dim& b) { return a.stride < b.stride; });
  uint64_t extent = p.head_bytes;
  for (const Dim& d : dims) {
    if (d.count <= 1) continue;
    if (d.stride < extent) return false;
    extent += d.stride * (d.count - 1);
  }
  return true;
}

}  // namespace detail

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
      if (!detail::cells_disjoint(p))
        throw std::invalid_argument(where + "cells overlap (page_stride " + std::to_string(p.page_stride) +
                                    ", token_stride " + std::to_string(p.token_stride) + ", head_stride " +
                                    std::to_string(p.head_stride) + ", head_bytes " + std::to_string(p.head_bytes) +
                                    ")");
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

  // The spans layer l's pages are copied as in pool order: one covering all its planes when
  // their cells tile it exactly (no gap, no overlap), else one per plane whose cells tile
  // its own; throws std::invalid_argument when neither holds.
  std::vector<PageSpan> page_spans(uint32_t l) const {
    std::vector<uint32_t> all(planes_per_layer_);
    for (uint32_t k = 0; k < planes_per_layer_; ++k) all[k] = k;
    if (std::optional<PageSpan> span = tiled_span(l, all)) return {*span};
    std::vector<PageSpan> spans;
    for (uint32_t k = 0; k < planes_per_layer_; ++k) {
      std::optional<PageSpan> span = tiled_span(l, {k});
      if (!span)
        throw std::invalid_argument("layer " + std::to_string(l) + " plane " + std::to_string(k) +
                                    ": its cells leave gaps within a page, so its pages cannot move in pool order");
      spans.push_back(std::move(*span));
    }
    return spans;
  }

  // The pool-order copy plan (see the top of this file); every selected layer must have
  // page_spans. Packs to as many bytes as the canonical plan without a head slice.
  template <typename Id>
  std::vector<CopyItem> plan_pool_order(const Id* ids, size_t n, const std::vector<int64_t>& layer_sel) const {
    const std::vector<uint32_t> layers = resolve_layers(layer_sel);
    check_page_ids(ids, n, layers);
    std::vector<CopyItem> items;
    uint64_t offset = 0;
    for (uint32_t l : layers) {
      for (const PageSpan& span : page_spans(l)) {
        for (size_t i = 0; i < n;) {
          const size_t run = run_length(ids, n, i);
          const uint64_t first = span.start + static_cast<uint64_t>(ids[i]) * span.page_stride;
          if (span.page_stride == span.bytes)
            items.push_back({first, offset, 1, run * span.bytes, 0, 0});
          else
            items.push_back({first, offset, run, span.bytes, span.page_stride, span.bytes});
          offset += run * span.bytes;
          i += run;
        }
      }
    }
    return items;
  }

  // Builds the copy plan. Runs of consecutive page ids become one item when whole,
  // densely strided pages move; otherwise each page becomes the fewest strided copies
  // its cell strides allow.
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
        const uint64_t slice_page = p.tokens_per_page * (h.end - h.begin) * p.head_bytes;
        size_t i = 0;
        while (i < n) {
          const size_t run = run_length(ids, n, i);
          const uint64_t page0 = p.base + static_cast<uint64_t>(ids[i]) * p.page_stride;
          const bool whole_pages = p.dense_page() && h.begin == 0 && h.end == p.num_heads;
          if (whole_pages && p.page_stride == p.page_bytes()) {
            items.push_back({page0, offset, 1, run * slice_page, 0, 0});
          } else if (whole_pages) {
            items.push_back({page0, offset, run, slice_page, p.page_stride, slice_page});
          } else if (p.dense_page() && p.page_stride == p.page_bytes()) {  // head slice of adjacent pages
            const uint64_t slice_row = (h.end - h.begin) * p.head_bytes;
            items.push_back({page0 + h.begin * p.head_bytes, offset, run * p.tokens_per_page, slice_row, p.row_bytes(),
                             slice_row});
          } else {
            for (size_t r = 0; r < run; ++r) plan_page(p, h, page0 + r * p.page_stride, offset + r * slice_page, items);
          }
          offset += run * slice_page;
          i += run;
        }
      }
    }
    return items;
  }

 private:
  // How many page ids from position i on are consecutive (ids[i], ids[i] + 1, ...).
  template <typename Id>
  static size_t run_length(const Id* ids, size_t n, size_t i) {
    size_t run = 1;
    while (i + run < n && static_cast<int64_t>(ids[i + run]) == static_cast<int64_t>(ids[i]) + static_cast<int64_t>(run))
      ++run;
    return run;
  }

  // The span page 0's cells of layer l's planes `ks` tile exactly, if they do, and no
  // wider than their (common) page stride.
  std::optional<PageSpan> tiled_span(uint32_t l, const std::vector<uint32_t>& ks) const {
    std::vector<std::pair<uint64_t, uint64_t>> cells;  // address, bytes
    const uint64_t stride = plane(l, ks.front()).page_stride;
    for (uint32_t k : ks) {
      const PlaneDesc& p = plane(l, k);
      if (p.page_stride != stride) return std::nullopt;
      if (p.dense_page()) {
        cells.emplace_back(p.base, p.page_bytes());
      } else {
        for (uint64_t t = 0; t < p.tokens_per_page; ++t) {
          if (p.heads_adjacent()) {
            cells.emplace_back(p.base + t * p.token_stride, p.row_bytes());
            continue;
          }
          for (uint64_t h = 0; h < p.num_heads; ++h)
            cells.emplace_back(p.base + t * p.token_stride + h * p.head_stride, p.head_bytes);
        }
      }
    }
    std::sort(cells.begin(), cells.end());
    for (size_t i = 1; i < cells.size(); ++i)
      if (cells[i].first != cells[i - 1].first + cells[i - 1].second) return std::nullopt;
    PageSpan span{cells.front().first, cells.back().first + cells.back().second - cells.front().first, stride, {}};
    if (span.bytes > stride && plane(l, ks.front()).num_pages > 1) return std::nullopt;
    for (uint32_t k : ks) {
      const PlaneDesc& p = plane(l, k);
      span.planes.push_back({l, k, p.base - span.start, p.tokens_per_page, p.num_heads, p.head_bytes, p.token_stride,
                             p.head_stride});
    }
    return span;
  }

  // Copies for the selected heads of one page, packed token after token.
  static void plan_page(const PlaneDesc& p, HeadRange h, uint64_t page, uint64_t packed, std::vector<CopyItem>& out) {
    const uint64_t heads = h.end - h.begin;
    const uint64_t slice_row = heads * p.head_bytes;
    const uint64_t first = page + h.begin * p.head_stride;
    if (p.heads_adjacent()) {  // each token's selected heads are one run
      out.push_back({first, packed, p.tokens_per_page, slice_row, p.token_stride, slice_row});
    } else if (heads == p.num_heads && p.cells_uniform()) {  // every cell, evenly spaced
      out.push_back({first, packed, p.tokens_per_page * heads, p.head_bytes, p.head_stride, p.head_bytes});
    } else {  // one strided copy per selected head
      for (uint64_t j = 0; j < heads; ++j)
        out.push_back({first + j * p.head_stride, packed + j * p.head_bytes, p.tokens_per_page, p.head_bytes,
                       p.token_stride, slice_row});
    }
  }

  std::vector<PlaneDesc> planes_;
  uint32_t planes_per_layer_;
};

}  // namespace pddcore
