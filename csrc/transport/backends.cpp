// The registry of data-path backends an engine can be built with.
#include <stdexcept>

#include "engine.h"
#include "tcp/tcp_backend.h"
#ifdef PDDCORE_WITH_RDMA
#include "rdma/rdma_backend.h"
#endif

namespace pddcore::transfer {

std::unique_ptr<TransferBackend> make_backend(BackendHost& host) {
  const std::string& name = host.options().backend;
  if (name == "tcp") return std::make_unique<tcp::TcpBackend>(host);
#ifdef PDDCORE_WITH_RDMA
  const EngineOptions& o = host.options();
  if (name == "rdma") return std::make_unique<rdma::RdmaBackend>(host, rdma::DeviceChoice{o.rdma_device, o.ib_port, o.gid_index});
  throw std::invalid_argument("unknown transfer backend '" + name + "'; available in this build: tcp, rdma");
#else
  if (name == "rdma")
    throw std::invalid_argument("the rdma backend is not in this build (the ibverbs headers were missing when it was "
                                "compiled); available: tcp");
  throw std::invalid_argument("unknown transfer backend '" + name + "'; available in this build: tcp");
#endif
}

std::vector<std::unique_ptr<TransferBackend>> make_backends(BackendHost& host) {
  std::vector<std::unique_ptr<TransferBackend>> out;
  out.push_back(make_backend(host));
  if (std::string(out.front()->name()) != "tcp") out.push_back(std::make_unique<tcp::TcpBackend>(host));
  return out;
}

}  // namespace pddcore::transfer
