// The engine's listener: accepts connections and serves each on its own thread, within
// the caps on connections in all and per client IP (counted from accept, before any
// authentication, so an unauthenticated flood cannot take every thread).
#pragma once

#include <atomic>
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
  // Serves one accepted connection on its thread until it returns (it must not throw);
  // host is the client's IP.
  using Handler = std::function<void(Socket& socket, const std::string& host)>;

  // Starts accepting on `listener`. refused counts connections closed at once (caps reached,
  // or no thread could be started).
  ConnectionServer(Socket listener, size_t max_connections, size_t max_per_host, Handler handler,
                   std::atomic<uint64_t>& refused);
  ~ConnectionServer() { close(); }
  ConnectionServer(const ConnectionServer&) = delete;
  ConnectionServer& operator=(const ConnectionServer&) = delete;

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
  };

  void accept_loop();
  void admit(Socket socket);

  Socket listener_;
  const size_t max_connections_, max_per_host_;
  const Handler handler_;
  std::atomic<uint64_t>& refused_;
  std::atomic<bool> closing_{false};
  std::mutex mutex_;
  std::list<std::unique_ptr<Connection>> connections_;
  std::thread accept_thread_;
};

}  // namespace pddcore::transfer
