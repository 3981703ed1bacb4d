// Blocking TCP sockets with deadlines: every call that could wait takes a timeout, so
// nothing in the engine waits forever on a silent peer.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

namespace pddcore::transfer {

class TlsChannel;

// Owns one file descriptor. shutdown() may be called from another thread to wake a
// blocked send/recv; the descriptor itself is closed only by the destructor.
class Socket {
 public:
  Socket();
  explicit Socket(int fd);
  Socket(Socket&& o) noexcept;
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;
  ~Socket();

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void shutdown() const;

  // Deadline for each blocking recv/send; 0 disables it.
  void set_timeouts(double recv_s, double send_s) const;
  void set_nodelay() const;
  // TCP_CONGESTION: the kernel's congestion control for this connection ("cubic", "bbr", ...);
  // throws std::invalid_argument when the kernel does not offer it.
  void set_congestion_control(const std::string& name) const;
  // The congestion control this connection runs now ("" where the kernel does not say).
  std::string congestion_control() const;
  // From now on every byte goes through this TLS session (see tls.h).
  void attach_tls(std::unique_ptr<TlsChannel> channel);
  bool encrypted() const { return tls_ != nullptr; }

  // Sends everything or throws TransferError.
  void send_all(const void* data, size_t n) const;
  void sendv_all(iovec* iov, int count) const;
  // Receives exactly n bytes or throws TransferError (EOF, timeout, error).
  void recv_all(void* data, size_t n) const;
  // recv_all that also ends at an absolute deadline (now_ns() clock), however the bytes
  // trickle in: a peer sending one byte per timeout cannot stretch it.
  void recv_all_before(void* data, size_t n, int64_t deadline_ns) const;
  // Like recv_all, but returns false when the receive deadline passes before the first
  // byte (an idle connection); a frame cut off midway still throws.
  bool recv_frame(void* data, size_t n) const;
  // Like recv_frame, but returns false at once when no byte of the frame has arrived yet.
  bool poll_frame(void* data, size_t n) const;
  // Receives at least one and at most n bytes; returns how many, or throws TransferError.
  size_t recv_some(void* data, size_t n) const;
  // recv_some scattered over several buffers, filled in order.
  size_t recvv_some(iovec* iov, int count) const;

 private:
  static constexpr size_t kNothingYet = 0;
  // One recv with `flags`: the byte count (> 0), kNothingYet when the deadline passed or
  // (MSG_DONTWAIT) nothing was queued; throws on EOF or error.
  size_t receive(void* data, size_t n, int flags) const;
  bool frame(void* data, size_t n, int flags) const;

  int fd_ = -1;
  std::unique_ptr<TlsChannel> tls_;
};

// Lets another thread end a dial that waits on a peer that does not answer (a host that is
// down leaves the connect unanswered, a frozen peer the handshake, each up to timeout_s):
// abort() shuts down the dial's socket, now or as soon as it is armed, and every later arm()
// throws. The dialing thread arms it once its socket exists and disarms it before that
// socket is handed on or closed, so abort() never touches a descriptor that was closed (and
// perhaps reused).
class DialAbort {
 public:
  void abort();
  void arm(const Socket& socket);  // throws TransferError once aborted
  void disarm();
  bool aborted();

  // Arms `abort` (when not null) for its lifetime.
  class Armed {
   public:
    Armed(DialAbort* abort, const Socket& socket);
    ~Armed();
    Armed(const Armed&) = delete;
    Armed& operator=(const Armed&) = delete;

   private:
    DialAbort* abort_;
  };

 private:
  std::mutex mutex_;
  int fd_ = -1;
  bool aborted_ = false;
};

struct HostPort {
  std::string host;
  uint16_t port = 0;
};

// Parses "host:port" (IPv4 literal or name); throws std::invalid_argument.
HostPort parse_address(const std::string& address);
std::string format_address(const HostPort& hp);

// Listens on host:port (port 0: any free port); returns the socket and the bound port.
Socket listen_tcp(const HostPort& at, uint16_t* bound_port);
// Connects within timeout_s or throws TransferError. congestion_control: TCP_CONGESTION set
// before the SYN, so the connection runs it from its first byte ("": the kernel's default).
// `abort` (when not null) is armed while the connect waits.
Socket dial_tcp(const HostPort& to, double timeout_s, const std::string& congestion_control = "",
                DialAbort* abort = nullptr);
// The remote IPv4 address of a connected socket ("1.2.3.4").
std::string peer_ip(const Socket& s);

}  // namespace pddcore::transfer
