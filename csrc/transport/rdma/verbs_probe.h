// Asks the system's libibverbs, loaded with dlopen, how many RDMA devices exist.
// Needs no verbs headers, so `pddcore info` can answer on any machine.
#pragma once

#include <string>

namespace pddcore::rdma {

struct VerbsProbe {
  bool library_loaded = false;  // libibverbs.so.1 was found and opened
  int device_count = 0;
  std::string detail;           // why there are no devices, when there are none
};

VerbsProbe probe_verbs();

}  // namespace pddcore::rdma
