// pddcore._verbs_emulator: the verbs emulator, a test device (see its header). The RDMA
// backend loads this module with dlopen; Python imports it only to read its counters.
#include <nanobind/nanobind.h>

#include "../transport/rdma/emulator/verbs_emulator.h"

namespace nb = nanobind;
using namespace pddcore::rdma;

NB_MODULE(_verbs_emulator, m) {
  m.doc() = "The verbs emulator (a software RDMA NIC for tests): its object and traffic counters.";
  m.def(
      "counters",
      [] {
        const emulator::Counters c = emulator::counters();
        nb::dict d;
        d["contexts"] = c.contexts;
        d["pds"] = c.pds;
        d["mrs"] = c.mrs;
        d["cqs"] = c.cqs;
        d["qps"] = c.qps;
        d["wire_connections"] = c.wire_connections;
        d["writes_placed"] = c.writes_placed;
        d["bytes_placed"] = c.bytes_placed;
        d["writes_rejected"] = c.writes_rejected;
        return d;
      },
      "Objects alive in this process (contexts, pds, mrs, cqs, qps, wire_connections) and "
      "traffic (writes_placed, bytes_placed, writes_rejected).");
}
