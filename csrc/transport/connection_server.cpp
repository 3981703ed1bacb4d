#include "connection_server.h"

#include <poll.h>
#include <sys/socket.h>

#include <exception>

namespace pddcore::transfer {

ConnectionServer::ConnectionServer(Socket listener, size_t max_connections, size_t max_per_host, Handler handler,
                                   std::atomic<uint64_t>& refused)
    : listener_(std::move(listener)),
      max_connections_(max_connections),
      max_per_host_(max_per_host),
      handler_(std::move(handler)),
      refused_(refused),
      accept_thread_([this] { accept_loop(); }) {}

void ConnectionServer::stop_accepting() {
  if (closing_.exchange(true)) return;
  listener_.shutdown();
  accept_thread_.join();
}

void ConnectionServer::close() {
  stop_accepting();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& conn : connections_) conn->socket.shutdown();
  }
  for (auto& conn : connections_) conn->thread.join();
  connections_.clear();
}

void ConnectionServer::accept_loop() {
  while (!closing_) {
    pollfd pfd{listener_.fd(), POLLIN, 0};
    if (::poll(&pfd, 1, 200) <= 0) continue;
    const int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    try {
      admit(Socket(fd));
    } catch (const std::exception&) {
      ++refused_;  // e.g. no thread could be started: that connection is closed, the server goes on
    }
  }
}

void ConnectionServer::admit(Socket socket) {
  const std::string host = peer_ip(socket);
  std::lock_guard<std::mutex> lock(mutex_);
  size_t from_host = 0;
  for (auto it = connections_.begin(); it != connections_.end();) {
    if ((*it)->done) {
      (*it)->thread.join();
      it = connections_.erase(it);
    } else {
      from_host += (*it)->host == host;
      ++it;
    }
  }
  if (connections_.size() >= max_connections_ || from_host >= max_per_host_) {
    ++refused_;
    return;  // the socket closes here
  }
  auto conn = std::make_unique<Connection>();
  conn->socket = std::move(socket);
  conn->host = host;
  Connection* raw = conn.get();
  conn->thread = std::thread([this, raw] {
    handler_(raw->socket, raw->host);
    raw->socket.shutdown();
    raw->done = true;
  });
  connections_.push_back(std::move(conn));
}

}  // namespace pddcore::transfer
