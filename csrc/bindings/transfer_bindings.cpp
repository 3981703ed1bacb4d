// pddcore._C transfer-engine exports: argument conversion only; logic lives in
// csrc/transport. Every call that can wait releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "../transport/engine.h"
#include "../transport/engine_arguments.h"

namespace nb = nanobind;
using namespace pddcore::transfer;

namespace {

using WriteTuple = std::tuple<uint64_t, uint64_t, uint64_t, uint64_t, uint64_t>;

std::string to_string(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

}  // namespace

void bind_transfer(nb::module_& m) {
  m.def("aes_gcm_seal_rate", &aes_gcm_seal_rate, nb::arg("total_bytes"), nb::call_guard<nb::gil_scoped_release>());
  m.def("engine_id_for_name", &engine_id_for_name, nb::arg("name"));
  m.def("available_congestion_controls", &available_congestion_controls);
  m.attr("MIN_AUTH_TOKEN_BYTES") = kMinAuthTokenBytes;
  nb::exception<TransferError>(m, "TransferError", PyExc_RuntimeError);

  nb::class_<Peer>(m, "PeerHandle")
      .def_prop_ro("address", [](const Peer& p) { return p.info.address; })
      .def_prop_ro("engine_id", [](const Peer& p) { return p.info.engine_id; })
      .def_prop_ro("connected", [](const Peer& p) { return p.alive.load(); });

  nb::class_<TransferState>(m, "TransferHandle")
      .def_prop_ro("id", [](const TransferState& t) { return t.id; })
      .def_prop_ro("total_bytes", [](const TransferState& t) { return t.total_bytes; })
      .def_prop_ro("bytes_acked", [](const TransferState& t) { return t.bytes_acked.load(); })
      .def_prop_ro("status", [](const TransferState& t) { return static_cast<int>(t.status()); })
      .def_prop_ro("error", &TransferState::error)
      .def("wait", &TransferState::wait, nb::arg("timeout_s"), nb::call_guard<nb::gil_scoped_release>());

  nb::class_<Engine>(m, "TransferEngineCore")
      .def(
          "__init__",
          [](Engine* self, const std::string& backend, const std::string& listen, std::optional<int64_t> streams,
             int64_t chunk_bytes, std::optional<nb::bytes> auth_token, bool insecure, bool tls, const std::string& tls_ca,
             const std::string& tls_cert, const std::string& tls_key, std::optional<std::string> congestion_control,
             double timeout_s, std::optional<double> rate_limit_bps, std::optional<double> queue_delay_target_s,
             int64_t max_retries, int64_t max_connections, int64_t max_connections_per_host, int64_t max_inbox_bytes,
             double idle_timeout_s, std::optional<std::string> rdma_device, int64_t ib_port,
             std::optional<int64_t> gid_index) {
            std::optional<std::string> token;
            if (auth_token) token = to_string(*auth_token);
            const EngineArguments a{backend, listen, streams, chunk_bytes, std::move(token), insecure, tls, tls_ca,
                                    tls_cert, tls_key, std::move(congestion_control), timeout_s, rate_limit_bps,
                                    queue_delay_target_s, max_retries, max_connections, max_connections_per_host,
                                    max_inbox_bytes, idle_timeout_s, std::move(rdma_device), ib_port, gid_index};
            nb::gil_scoped_release release;
            new (self) Engine(engine_options(a));
          },
          nb::arg("backend"), nb::arg("listen"), nb::arg("streams").none(), nb::arg("chunk_bytes"),
          nb::arg("auth_token").none(), nb::arg("insecure"), nb::arg("tls"), nb::arg("tls_ca"), nb::arg("tls_cert"),
          nb::arg("tls_key"), nb::arg("congestion_control").none(), nb::arg("timeout_s"),
          nb::arg("rate_limit_bps").none(), nb::arg("queue_delay_target_s").none(), nb::arg("max_retries"),
          nb::arg("max_connections"), nb::arg("max_connections_per_host"), nb::arg("max_inbox_bytes"),
          nb::arg("idle_timeout_s"), nb::arg("rdma_device").none(), nb::arg("ib_port"), nb::arg("gid_index").none())
      .def_prop_ro("congestion_control", [](const Engine& e) { return e.options().congestion_control; })
      .def_prop_ro("address", &Engine::address)
      .def_prop_ro("engine_id", &Engine::engine_id)
      .def_prop_ro("backend", &Engine::backend_name)
      .def("close", &Engine::close, nb::call_guard<nb::gil_scoped_release>())
      .def("register_memory", &Engine::register_memory, nb::arg("base"), nb::arg("size"), nb::arg("target"),
           nb::arg("listed_address"))
      .def("unregister_memory", &Engine::unregister_memory, nb::arg("region_id"),
           nb::call_guard<nb::gil_scoped_release>())
      .def("connect", &Engine::connect, nb::arg("address"), nb::arg("backend") = "",
           nb::call_guard<nb::gil_scoped_release>())
      .def("disconnect", &Engine::disconnect, nb::arg("peer"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "write_batch",
          [](Engine& e, const std::shared_ptr<Peer>& peer, const std::vector<WriteTuple>& writes,
             std::optional<nb::bytes> notify) {
            std::vector<WriteOp> ops;
            for (const auto& [so, soff, dr, doff, n] : writes) ops.push_back({so, soff, dr, doff, n});
            std::optional<std::string> note;
            if (notify) note = to_string(*notify);
            nb::gil_scoped_release release;
            return e.write_batch(peer, ops, std::move(note));
          },
          nb::arg("peer"), nb::arg("writes"), nb::arg("notify").none())
      .def("cancel", &Engine::cancel, nb::arg("transfer"), nb::call_guard<nb::gil_scoped_release>())
      .def(
          "send",
          [](Engine& e, const std::shared_ptr<Peer>& peer, nb::bytes message) {
            std::string body = to_string(message);
            nb::gil_scoped_release release;
            e.send(peer, body);
          },
          nb::arg("peer"), nb::arg("message"))
      .def(
          "poll_messages",
          [](Engine& e, double timeout_s) {
            std::vector<InboxEntry> got;
            {
              nb::gil_scoped_release release;
              got = e.poll_messages(timeout_s);
            }
            nb::list out;
            for (auto& m : got)
              out.append(nb::make_tuple(m.sender, m.sender_engine_id, nb::bytes(m.payload.data(), m.payload.size()),
                                        m.notification));
            return out;
          },
          nb::arg("timeout_s"))
      .def(
          "remote_regions",
          [](Engine& e, const std::shared_ptr<Peer>& peer) {
            std::vector<std::tuple<uint64_t, uint64_t, uint64_t>> out;
            {
              nb::gil_scoped_release release;
              for (const auto& r : e.remote_regions(peer)) out.emplace_back(r.region_id, r.base_address, r.size);
            }
            return out;
          },
          nb::arg("peer"))
      .def("totals", &Engine::totals)
      .def("peer_stats", &Engine::peer_stats)
      .def("debug_kill_stream", &Engine::debug_kill_stream, nb::arg("peer"), nb::arg("stream"))
      .def("debug_corrupt_chunks", &Engine::debug_corrupt_chunks, nb::arg("n"));
}
