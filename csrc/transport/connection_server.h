// The engine's listener: accepts connections and serves each on its own thread, within
// budgets counted from accept. A connection is unauthenticated until its handler says the
// peer proved the token; unauthenticated connections have their own, smaller budget (in all
// and per client IP), so a flood of handshakes from a few hosts can neither take every
// thread nor keep an authenticated peer out: when that budget is full, a newcomer from an
// address holding fewer handshakes displaces the oldest handshake of the address holding
// the most. Authenticated connections have the larger budget.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "socket.h"

namespace pddcore::transfer {

class ConnectionServer {
 public:
  // Connections served at once.
  struct Limits {
    size_t authenticated;
    size_t authenticated_per_host;
    size_t unauthenticated;
    size_t unauthenticated_per_host;
  };
  // The budgets of an engine asked for max_connections (max_per_host from one IP): the
  // authenticated budget is clamped so that every served connection together stays within
  // half of this process's file descriptor limit (RLIMIT_NOFILE; the rest is the engine's
  // own connections and the caller's files); the unauthenticated budgets are a quarter of
  // the authenticated ones (at least 1).
  static Limits limits_for(size_t max_connections, size_t max_per_host);

  // Says the connection's peer authenticated; false when the authenticated budget is full
  // (or the connection was displaced): the handler then closes the connection.
  using Authenticated = std::function<bool()>;
  // Serves one accepted connection on its thread until it returns (it must not throw);
  // host is the client's IP.
  using Handler = std::function<void(Socket& socket, const std::string& host, const Authenticated& authenticated)>;

  // Starts accepting on `listener`. refused counts connections closed by a budget (at
  // accept, displaced, or at authentication) or because no thread could be started.
  ConnectionServer(Socket listener, Limits limits, Handler handler, std::atomic<uint64_t>& refused);
  ~ConnectionServer() { close(); }
  ConnectionServer(const ConnectionServer&) = delete;
  ConnectionServer& operator=(const ConnectionServer&) = delete;

  const Limits& limits() const { return limits_; }
  // Times accept() failed for want of file descriptors or memory; the loop then backs off.
  uint64_t accept_stalls() const { return accept_stalls_; }

  // Stops accepting new connections; idempotent.
  void stop_accepting();
  // stop_accepting(), then shuts every served socket down and joins its thread; idempotent.
  void close();

 private:
  struct Connection {
    Socket socket;
    std::string host;
    std::thread thread;
    std::atomic<bool> done{false};
    bool authenticated = false;  // under mutex_
    bool displaced = false;      // under mutex_: shut down to make room; counts no more
  };

  void accept_loop();
  void admit(Socket socket);
  bool authenticate(Connection& conn);
  // Waits up to `pause`, or until close; used to back off when accept() lacks resources.
  void back_off(std::chrono::milliseconds pause);

  Socket listener_;
  const Limits limits_;
  const Handler handler_;
  std::atomic<uint64_t>& refused_;
  std::atomic<uint64_t> accept_stalls_{0};
  std::atomic<bool> closing_{false};
  std::mutex wake_mutex_;
  std::condition_variable wake_;  // notified on stop_accepting
  std::mutex mutex_;
  std::list<std::unique_ptr<Connection>> connections_;  // in accept order
  std::thread accept_thread_;
};

}  // namespace pddcore::transfer
