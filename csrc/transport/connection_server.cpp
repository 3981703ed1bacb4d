#include "connection_server.h"

#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <exception>
#include <map>

namespace pddcore::transfer {

ConnectionServer::Limits ConnectionServer::limits_for(size_t max_connections, size_t max_per_host) {
  rlimit fds{};
  size_t authenticated = max_connections;
  if (::getrlimit(RLIMIT_NOFILE, &fds) == 0 && fds.rlim_cur != RLIM_INFINITY) {
    // authenticated + authenticated / 4 <= fd limit / 2
    authenticated = std::min<size_t>(authenticated, static_cast<size_t>(fds.rlim_cur) * 2 / 5);
  }
  authenticated = std::max<size_t>(authenticated, 1);
  const size_t per_host = std::min(std::max<size_t>(max_per_host, 1), authenticated);
  return {authenticated, per_host, std::max<size_t>(authenticated / 4, 1), std::max<size_t>(per_host / 4, 1)};
}

ConnectionServer::ConnectionServer(Socket listener, Limits limits, Handler handler, std::atomic<uint64_t>& refused)
    : listener_(std::move(listener)),
      limits_(limits),
      handler_(std::move(handler)),
      refused_(refused),
      accept_thread_([this] { accept_loop(); }) {}

void ConnectionServer::stop_accepting() {
  {
    std::lock_guard<std::mutex> lock(wake_mutex_);
    if (closing_.exchange(true)) return;
  }
  wake_.notify_all();
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

void ConnectionServer::back_off(std::chrono::milliseconds pause) {
  std::unique_lock<std::mutex> lock(wake_mutex_);
  wake_.wait_for(lock, pause, [this] { return closing_.load(); });
}

void ConnectionServer::accept_loop() {
  // Out of descriptors (or memory), accept() fails at once while the connection stays
  // queued and the listener stays readable: retrying at once would spin a core.
  constexpr std::chrono::milliseconds kFirstPause{10}, kLongestPause{500};
  std::chrono::milliseconds pause = kFirstPause;
  while (!closing_) {
    pollfd pfd{listener_.fd(), POLLIN, 0};
    if (::poll(&pfd, 1, 200) <= 0) continue;
    const int fd = ::accept4(listener_.fd(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        ++accept_stalls_;
        back_off(pause);
        pause = std::min(pause * 2, kLongestPause);
      }
      continue;
    }
    pause = kFirstPause;
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
  std::map<std::string, size_t> handshakes;  // unauthenticated connections per host
  size_t unauthenticated = 0;
  for (auto it = connections_.begin(); it != connections_.end();) {
    Connection& conn = **it;
    if (conn.done) {
      conn.thread.join();
      it = connections_.erase(it);
      continue;
    }
    if (!conn.authenticated && !conn.displaced) {
      ++handshakes[conn.host];
      ++unauthenticated;
    }
    ++it;
  }
  const size_t from_host = handshakes[host];
  if (from_host >= limits_.unauthenticated_per_host) {
    ++refused_;
    return;  // the socket closes here
  }
  if (unauthenticated >= limits_.unauthenticated) {
    const auto busiest = std::max_element(handshakes.begin(), handshakes.end(),
                                          [](const auto& a, const auto& b) { return a.second < b.second; });
    if (busiest->second <= from_host) {
      ++refused_;
      return;
    }
    for (auto& conn : connections_) {  // the busiest host's oldest handshake makes room
      if (conn->host == busiest->first && !conn->authenticated && !conn->displaced && !conn->done) {
        conn->displaced = true;
        conn->socket.shutdown();
        ++refused_;
        break;
      }
    }
  }
  auto conn = std::make_unique<Connection>();
  conn->socket = std::move(socket);
  conn->host = host;
  Connection* raw = conn.get();
  conn->thread = std::thread([this, raw] {
    handler_(raw->socket, raw->host, [this, raw] { return authenticate(*raw); });
    raw->socket.shutdown();
    raw->done = true;
  });
  connections_.push_back(std::move(conn));
}

bool ConnectionServer::authenticate(Connection& conn) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (conn.displaced) return false;
  size_t in_all = 0, from_host = 0;
  for (const auto& other : connections_) {
    if (!other->authenticated || other->done) continue;
    ++in_all;
    from_host += other->host == conn.host;
  }
  if (in_all >= limits_.authenticated || from_host >= limits_.authenticated_per_host) {
    ++refused_;
    return false;
  }
  conn.authenticated = true;
  return true;
}

}  // namespace pddcore::transfer
