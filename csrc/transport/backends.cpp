// The registry of data-path backends an engine can be built with.
#include <stdexcept>

#include "engine.h"
#include "tcp/tcp_backend.h"

namespace pddcore::transfer {

std::unique_ptr<TransferBackend> make_backend(BackendHost& host) {
  const std::string& name = host.options().backend;
  if (name == "tcp") return std::make_unique<tcp::TcpBackend>(host);
  throw std::invalid_argument("unknown transfer backend '" + name + "'; available in this build: tcp");
}

}  // namespace pddcore::transfer
