// pddcore._C: exports only. Logic lives in csrc/kv, csrc/transport and the headers.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "../kv/pack.h"
#include "../transport/rdma/verbs_probe.h"
#include "../wan/delay_line.h"
#include "pddcore/crc32c.h"
#include "pddcore/kv_layout.h"

namespace nb = nanobind;
using namespace pddcore;

void bind_transfer(nb::module_& m);  // transfer_bindings.cpp

namespace {

// (base, num_pages, page_stride, tokens_per_page, num_heads, head_bytes, token_stride, head_stride)
using PlaneTuple = std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>;
using ByteBuffer = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig>;
using IdArray = nb::ndarray<nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using DeviceTable = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cuda>;

kv::PageIds page_ids_of(const IdArray& ids) {
  const bool i64 = ids.dtype() == nb::dtype<int64_t>();
  if (!i64 && ids.dtype() != nb::dtype<int32_t>()) throw std::invalid_argument("page_ids must be int32 or int64");
  return {ids.data(), ids.shape(0), i64};
}

kv::Direction direction(bool pack) { return pack ? kv::Direction::kPack : kv::Direction::kUnpack; }

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "pddcore native core";

  nb::class_<KVLayoutDesc>(m, "KVLayoutDesc")
      .def(
          "__init__",
          [](KVLayoutDesc* self, const std::vector<PlaneTuple>& planes, uint32_t planes_per_layer) {
            std::vector<PlaneDesc> descs;
            for (const auto& [base, num_pages, stride, tokens, heads, head_bytes, token_stride, head_stride] : planes)
              descs.push_back({base, num_pages, stride, tokens, heads, head_bytes, token_stride, head_stride});
            new (self) KVLayoutDesc(std::move(descs), planes_per_layer);
          },
          nb::arg("planes"), nb::arg("planes_per_layer"))
      .def_prop_ro("num_layers", &KVLayoutDesc::num_layers)
      .def_prop_ro("planes_per_layer", &KVLayoutDesc::planes_per_layer)
      .def(
          "packed_nbytes",
          [](const KVLayoutDesc& l, uint64_t n, std::vector<int64_t> layers, uint64_t h0, uint64_t h1) {
            return l.packed_nbytes(n, layers, {h0, h1});
          },
          nb::arg("num_pages"), nb::arg("layers"), nb::arg("h0"), nb::arg("h1"))
      .def(
          "pool_page_format",
          [](const KVLayoutDesc& l) {
            std::vector<std::vector<std::tuple<uint32_t, uint32_t, uint64_t, uint64_t, uint64_t, uint64_t, uint64_t,
                                               uint64_t>>> out;
            for (uint32_t layer = 0; layer < l.num_layers(); ++layer)
              for (const PageSpan& span : l.page_spans(layer)) {
                out.emplace_back();
                for (const SpanPlane& p : span.planes)
                  out.back().emplace_back(p.layer, p.plane, p.offset, p.tokens_per_page, p.num_heads, p.head_bytes,
                                          p.token_stride, p.head_stride);
              }
            return out;
          });

  nb::class_<kv::CopyPlan>(m, "CopyPlan")
      .def(
          "__init__",
          [](kv::CopyPlan* self, const KVLayoutDesc& l, const IdArray& ids, std::vector<int64_t> layers, uint64_t h0,
             uint64_t h1, bool for_cuda, bool pool_order) {
            new (self) kv::CopyPlan(l, page_ids_of(ids), layers, {h0, h1}, for_cuda, pool_order);
          },
          nb::arg("layout"), nb::arg("page_ids"), nb::arg("layers"), nb::arg("h0"), nb::arg("h1"), nb::arg("for_cuda"),
          nb::arg("pool_order") = false)
      .def_prop_ro("nbytes", &kv::CopyPlan::nbytes)
      .def_prop_ro("device_table_nbytes", &kv::CopyPlan::device_table_nbytes);
  m.def(
      "run_copy_plan_cpu",
      [](const kv::CopyPlan& plan, ByteBuffer buf, bool pack) {
        kv::run_cpu(plan, buf.data(), buf.shape(0), direction(pack));
      },
      nb::arg("plan"), nb::arg("buf").noconvert(), nb::arg("pack"), nb::call_guard<nb::gil_scoped_release>());
  m.def("check_cuda_layout", &kv::check_cuda_layout, nb::arg("layout"), nb::arg("device"));
  m.def(
      "upload_copy_plan",
      [](const kv::CopyPlan& plan, DeviceTable table, int device, uintptr_t stream) {
        kv::upload_cuda(plan, table.data(), table.shape(0), device, stream);
      },
      nb::arg("plan"), nb::arg("table").noconvert(), nb::arg("device"), nb::arg("stream"));
  m.def(
      "run_copy_plan_cuda",
      [](const kv::CopyPlan& plan, DeviceTable table, ByteBuffer buf, bool pack, int device, uintptr_t stream) {
        kv::run_cuda(plan, table.data(), table.shape(0), buf.data(), buf.shape(0),
                     buf.device_type() == nb::device::cpu::value, direction(pack), device, stream);
      },
      nb::arg("plan"), nb::arg("table").noconvert(), nb::arg("buf").noconvert(), nb::arg("pack"), nb::arg("device"),
      nb::arg("stream"), nb::call_guard<nb::gil_scoped_release>());

  m.def("set_num_threads", &kv::set_cpu_threads, nb::arg("n"));
  m.def("get_num_threads", &kv::cpu_threads);
  m.def("cuda_compiled", &kv::cuda_compiled);
  m.def("cuda_unusable_reason", &kv::cuda_unusable_reason);
  m.def("cuda_device_count", &kv::cuda_device_count);

  m.def(
      "crc32c",
      [](nb::bytes data, uint32_t crc, std::optional<std::string> implementation) {
        return crc32c_with(implementation ? crc32c_impl_named(*implementation) : crc32c_best(), data.c_str(),
                           data.size(), crc);
      },
      nb::arg("data"), nb::arg("crc") = 0, nb::arg("implementation") = nb::none());
  m.def("crc32c_implementation", [] { return std::string(crc32c_name(crc32c_best())); });
  m.def("crc32c_implementations", [] {
    std::vector<std::string> names;
    for (Crc32cImpl impl : kCrc32cImpls)
      if (crc32c_supported(impl)) names.emplace_back(crc32c_name(impl));
    return names;
  });

  bind_transfer(m);

  m.def("probe_verbs", [] {
    const rdma::VerbsProbe p = rdma::probe_verbs();
    return std::make_tuple(p.library_loaded, p.device_count, p.detail);
  });
#ifdef PDDCORE_WITH_RDMA
  m.def("rdma_compiled", [] { return true; });
#else
  m.def("rdma_compiled", [] { return false; });
#endif

  m.def("delay_line_stat_names", &wan::delay_line_stat_names);
  m.def(
      "run_delay_line",
      [](int fd_a, int fd_b, int stop_fd, uint64_t delay_ns, uint64_t jitter_ns, double loss, uint64_t seed,
         size_t queue_bytes, nb::ndarray<uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> stats, int cpu) {
        wan::run_delay_line({fd_a, fd_b, stop_fd, delay_ns, jitter_ns, loss, seed, queue_bytes, cpu}, stats.data(),
                            stats.shape(0));
      },
      nb::arg("fd_a"), nb::arg("fd_b"), nb::arg("stop_fd"), nb::arg("delay_ns"), nb::arg("jitter_ns"), nb::arg("loss"),
      nb::arg("seed"), nb::arg("queue_bytes"), nb::arg("stats").noconvert(), nb::arg("cpu") = -1,
      nb::call_guard<nb::gil_scoped_release>());
}
