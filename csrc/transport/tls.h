// Optional TLS 1.3 on an engine's connections, keyed by a pre-shared key derived from the
// engine's auth token: both ends prove the key (mutual), every byte after the TCP connect
// is encrypted and authenticated (AES-128-GCM), with ephemeral (EC)DHE keys per connection.
//
// A TLS socket is non-blocking underneath and serialises its OpenSSL calls, so one thread
// may read while another writes (a data stream's sender and its ack reader), as on a plain
// socket; waits happen in poll(), outside the lock, bounded by the socket's timeouts.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>

#include "pddcore/transfer_backend.h"

typedef struct ssl_st SSL;
typedef struct ssl_ctx_st SSL_CTX;

namespace pddcore::transfer {

class Socket;

// A TLS record failed its authentication (tampered or corrupted), or the handshake failed.
struct TlsError : TransferError {
  using TransferError::TransferError;
};

// One connection's TLS session; owned by its Socket.
class TlsChannel {
 public:
  TlsChannel(SSL* ssl, int fd, double recv_timeout_s, double send_timeout_s);
  ~TlsChannel();
  TlsChannel(const TlsChannel&) = delete;
  TlsChannel& operator=(const TlsChannel&) = delete;

  // At least one byte, or 0 when nothing arrived within the receive timeout (at once with
  // dont_wait); throws on close, error or a record that fails authentication.
  size_t read(void* data, size_t n, bool dont_wait);
  // read() into the buffers in order; returns after the first buffer's bytes, plus whatever
  // is already decrypted for the next ones.
  size_t readv(iovec* iov, int count);
  void write(const iovec* iov, int count);
  void set_timeouts(double recv_s, double send_s);

 private:
  enum class Want { kRead, kWrite };
  // Waits until the socket is ready for `want`; false when timeout_s (0: forever) passed.
  bool wait(Want want, double timeout_s) const;

  std::mutex mutex_;  // guards every call on ssl_, and broken_
  SSL* ssl_;
  std::string broken_;  // why a record read ahead was rejected: the next read throws it
  const int fd_;
  std::atomic<double> recv_timeout_s_, send_timeout_s_;
};

// An engine's TLS configuration: client and server contexts sharing the pre-shared key.
class TlsContext {
 public:
  explicit TlsContext(const std::string& auth_token);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  // Runs the TLS handshake on a connected socket (within timeout_s) and attaches the session.
  void secure_client(Socket& s, double timeout_s) const;
  void secure_server(Socket& s, double timeout_s) const;

  const std::string& psk() const { return psk_; }

 private:
  void secure(Socket& s, SSL_CTX* ctx, bool client, double timeout_s) const;

  std::string psk_;
  SSL_CTX* client_ = nullptr;
  SSL_CTX* server_ = nullptr;
};

// Bytes per second one core seals (encrypts and tags) with TLS 1.3's AES-128-GCM, in
// 16 KiB records, over `total_bytes`: what a TLS sender's cipher alone could carry.
double aes_gcm_seal_rate(uint64_t total_bytes);

}  // namespace pddcore::transfer
