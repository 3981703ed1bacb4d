#include "socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "pddcore/transfer_backend.h"
#include "tls.h"

namespace pddcore::transfer {

namespace {

[[noreturn]] void throw_errno(const std::string& what, int err) {
  throw TransferError(what + ": " + std::strerror(err));
}

timeval to_timeval(double s) {
  timeval tv{};
  if (s > 0) {
    tv.tv_sec = static_cast<time_t>(s);
    tv.tv_usec = static_cast<suseconds_t>((s - std::floor(s)) * 1e6);
    if (tv.tv_sec == 0 && tv.tv_usec == 0) tv.tv_usec = 1;
  }
  return tv;
}

sockaddr_in resolve(const HostPort& hp) {
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(hp.port);
  if (inet_pton(AF_INET, hp.host.c_str(), &sa.sin_addr) == 1) return sa;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(hp.host.c_str(), nullptr, &hints, &res) != 0 || res == nullptr)
    throw std::invalid_argument("cannot resolve host '" + hp.host + "'");
  sa.sin_addr = reinterpret_cast<sockaddr_in*>(res->ai_addr)->sin_addr;
  freeaddrinfo(res);
  return sa;
}

}  // namespace

Socket::Socket() = default;
Socket::Socket(int fd) : fd_(fd) {}
Socket::Socket(Socket&& o) noexcept : fd_(std::exchange(o.fd_, -1)), tls_(std::move(o.tls_)) {}

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    tls_.reset();
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    tls_ = std::move(o.tls_);
  }
  return *this;
}

Socket::~Socket() {
  tls_.reset();
  if (fd_ >= 0) ::close(fd_);
}

void Socket::attach_tls(std::unique_ptr<TlsChannel> channel) { tls_ = std::move(channel); }

void Socket::shutdown() const {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void DialAbort::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  aborted_ = true;
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

void DialAbort::arm(const Socket& socket) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) throw TransferError("dial aborted: the link is stopping");
  fd_ = socket.fd();
}

void DialAbort::disarm() {
  std::lock_guard<std::mutex> lock(mutex_);
  fd_ = -1;
}

bool DialAbort::aborted() {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_;
}

DialAbort::Armed::Armed(DialAbort* abort, const Socket& socket) : abort_(abort) {
  if (abort_ != nullptr) abort_->arm(socket);
}

DialAbort::Armed::~Armed() {
  if (abort_ != nullptr) abort_->disarm();
}

void Socket::set_timeouts(double recv_s, double send_s) const {
  if (tls_) tls_->set_timeouts(recv_s, send_s);
  const timeval r = to_timeval(recv_s), s = to_timeval(send_s);
  setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &r, sizeof(r));
  setsockopt(fd_, SOL_SOCKET, SO_SNDTIMEO, &s, sizeof(s));
}

void Socket::set_congestion_control(const std::string& name) const {
  if (setsockopt(fd_, IPPROTO_TCP, TCP_CONGESTION, name.data(), static_cast<socklen_t>(name.size())) != 0)
    throw std::invalid_argument("congestion control '" + name + "' is not available: " + std::strerror(errno) +
                                " (see /proc/sys/net/ipv4/tcp_available_congestion_control)");
}

std::string Socket::congestion_control() const {
  char name[16] = {};  // the kernel's TCP_CA_NAME_MAX
  socklen_t len = sizeof(name);
  if (getsockopt(fd_, IPPROTO_TCP, TCP_CONGESTION, name, &len) != 0) return "";
  return std::string(name, strnlen(name, len));
}

void Socket::set_nodelay() const {
  const int one = 1;
  setsockopt(fd_, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

void Socket::send_all(const void* data, size_t n) const {
  iovec iov{const_cast<void*>(data), n};
  sendv_all(&iov, 1);
}

void Socket::sendv_all(iovec* iov, int count) const {
  if (tls_) return tls_->write(iov, count);
  while (count > 0) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    const ssize_t sent = ::sendmsg(fd_, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) throw TransferError("send timed out (peer not reading)");
      throw_errno("send failed", errno);
    }
    size_t left = static_cast<size_t>(sent);
    while (count > 0 && left >= iov->iov_len) {
      left -= iov->iov_len;
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + left;
      iov->iov_len -= left;
    }
  }
}

void Socket::recv_all(void* data, size_t n) const {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    // MSG_WAITALL: one wakeup and one syscall for the whole range, not one per segment.
    const size_t got = receive(p, n, MSG_WAITALL);
    if (got == kNothingYet) throw TransferError("receive timed out");
    p += got;
    n -= got;
  }
}

void Socket::recv_all_before(void* data, size_t n, int64_t deadline_ns) const {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const double left_s = static_cast<double>(deadline_ns - now_ns()) / 1e9;
    if (left_s <= 0) throw TransferError("deadline passed while receiving");
    set_timeouts(std::max(left_s, 1e-3), std::max(left_s, 1e-3));
    const size_t got = receive(p, n, MSG_WAITALL);
    p += got;
    n -= got;
  }
}

size_t Socket::recv_some(void* data, size_t n) const {
  const size_t got = receive(data, n, 0);
  if (got == kNothingYet) throw TransferError("receive timed out");
  return got;
}

size_t Socket::recvv_some(iovec* iov, int count) const {
  if (tls_) return tls_->readv(iov, count);
  for (;;) {
    msghdr msg{};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    const ssize_t got = ::recvmsg(fd_, &msg, 0);
    if (got == 0) throw TransferError("connection closed by peer");
    if (got > 0) return static_cast<size_t>(got);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) throw TransferError("receive timed out");
    throw_errno("receive failed", errno);
  }
}

bool Socket::recv_frame(void* data, size_t n) const { return frame(data, n, MSG_WAITALL); }

bool Socket::poll_frame(void* data, size_t n) const { return frame(data, n, MSG_DONTWAIT); }

bool Socket::frame(void* data, size_t n, int flags) const {
  const size_t got = receive(data, n, flags);
  if (got == kNothingYet) return false;
  if (got < n) recv_all(static_cast<uint8_t*>(data) + got, n - got);
  return true;
}

size_t Socket::receive(void* data, size_t n, int flags) const {
  if (tls_) return tls_->read(data, n, (flags & MSG_DONTWAIT) != 0);  // kNothingYet is 0 there too
  for (;;) {
    const ssize_t got = ::recv(fd_, data, n, flags);
    if (got == 0) throw TransferError("connection closed by peer");
    if (got > 0) return static_cast<size_t>(got);
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return kNothingYet;
    throw_errno("receive failed", errno);
  }
}

HostPort parse_address(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == address.size())
    throw std::invalid_argument("address must be 'host:port', got '" + address + "'");
  const std::string port_text = address.substr(colon + 1);
  char* end = nullptr;
  const long port = std::strtol(port_text.c_str(), &end, 10);
  if (*end != '\0' || port < 0 || port > 65535)
    throw std::invalid_argument("bad port in address '" + address + "'");
  return {address.substr(0, colon), static_cast<uint16_t>(port)};
}

std::string format_address(const HostPort& hp) { return hp.host + ":" + std::to_string(hp.port); }

Socket listen_tcp(const HostPort& at, uint16_t* bound_port) {
  const sockaddr_in sa = resolve(at);
  Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!s.valid()) throw_errno("socket", errno);
  const int one = 1;
  setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(s.fd(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0)
    throw_errno("cannot listen on " + format_address(at), errno);
  if (::listen(s.fd(), 256) != 0) throw_errno("listen", errno);
  sockaddr_in bound{};
  socklen_t len = sizeof(bound);
  getsockname(s.fd(), reinterpret_cast<sockaddr*>(&bound), &len);
  *bound_port = ntohs(bound.sin_port);
  return s;
}

Socket dial_tcp(const HostPort& to, double timeout_s, const std::string& congestion_control, DialAbort* abort) {
  const sockaddr_in sa = resolve(to);
  Socket s(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (!s.valid()) throw_errno("socket", errno);
  if (!congestion_control.empty()) s.set_congestion_control(congestion_control);
  // Shutting down a connecting socket ends its connect (ECONNRESET) and wakes the poll.
  const DialAbort::Armed armed(abort, s);
  if (::connect(s.fd(), reinterpret_cast<const sockaddr*>(&sa), sizeof(sa)) != 0) {
    if (errno != EINPROGRESS) throw_errno("cannot connect to " + format_address(to), errno);
    pollfd pfd{s.fd(), POLLOUT, 0};
    const int ready = ::poll(&pfd, 1, static_cast<int>(timeout_s * 1000));
    if (abort != nullptr && abort->aborted()) throw TransferError("dial aborted: the link is stopping");
    if (ready == 0) throw TransferError("connect to " + format_address(to) + " timed out");
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (ready < 0) err = errno;
    if (err != 0) throw_errno("cannot connect to " + format_address(to), err);
  }
  const int flags = fcntl(s.fd(), F_GETFL);
  fcntl(s.fd(), F_SETFL, flags & ~O_NONBLOCK);
  return s;
}

std::string peer_ip(const Socket& s) {
  sockaddr_in sa{};
  socklen_t len = sizeof(sa);
  getpeername(s.fd(), reinterpret_cast<sockaddr*>(&sa), &len);
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &sa.sin_addr, text, sizeof(text));
  return text;
}

}  // namespace pddcore::transfer
