// Optional TLS 1.3 on an engine's connections, in one of two modes:
// - pre-shared key: derived from the engine's auth token; both ends prove the key (mutual),
//   so every token holder is every engine;
// - certificates: each engine holds an X.509 certificate from the deployment's CA and both
//   ends verify the other's chain against that CA (mutual TLS). The certificate's subject
//   common name is the engine's name, and its engine id is derived from that name
//   (engine_id_for_name), so no engine can claim another's id.
// Either way every byte after the TCP connect is encrypted and authenticated (AES-128-GCM),
// with ephemeral (EC)DHE keys per connection.
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
#include <optional>
#include <string>

#include "pddcore/transfer_backend.h"

typedef struct ssl_st SSL;
typedef struct ssl_ctx_st SSL_CTX;

namespace pddcore::transfer {

// A TLS record failed its authentication (tampered or corrupted), or the handshake failed.
struct TlsError : TransferError {
  using TransferError::TransferError;
};

// One connection's TLS session, over a connected socket's descriptor (which it does not own).
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
  // Certificate mode: the engine id the peer's verified certificate names; empty with a
  // pre-shared key (the peer proved the token, which names no engine).
  const std::optional<uint64_t>& certified_peer_id() const { return certified_peer_id_; }

 private:
  friend class TlsContext;
  enum class Want { kRead, kWrite };
  // Waits until the socket is ready for `want`; false when timeout_s (0: forever) passed.
  bool wait(Want want, double timeout_s) const;

  std::mutex mutex_;  // guards every call on ssl_, and broken_
  SSL* ssl_;
  std::string broken_;  // why a record read ahead was rejected: the next read throws it
  const int fd_;
  std::atomic<double> recv_timeout_s_, send_timeout_s_;
  std::optional<uint64_t> certified_peer_id_;
};

// Certificate mode's files, all PEM: the deployment's CA (what a peer's chain must lead
// to), this engine's certificate (with any intermediates after it) and its private key.
struct TlsCertificates {
  std::string ca_file, cert_file, key_file;
};

// An engine's TLS configuration: client and server contexts sharing the pre-shared key or
// the certificates.
class TlsContext {
 public:
  // Pre-shared key mode.
  explicit TlsContext(const std::string& auth_token);
  // Certificate mode; throws std::invalid_argument when a file cannot be read, the key does
  // not match the certificate, or the certificate does not verify against the CA (expired,
  // another CA's, no common name).
  explicit TlsContext(const TlsCertificates& certificates);
  ~TlsContext();
  TlsContext(const TlsContext&) = delete;
  TlsContext& operator=(const TlsContext&) = delete;

  // Runs the TLS handshake on a connected socket's descriptor (within timeout_s) and returns
  // the session, which from then on carries every byte of that socket. Certificate mode
  // refuses a peer whose chain does not verify against the CA.
  std::unique_ptr<TlsChannel> secure_client(int fd, double timeout_s) const;
  std::unique_ptr<TlsChannel> secure_server(int fd, double timeout_s) const;

  const std::string& psk() const { return psk_; }
  // Certificate mode: the engine id this engine's own certificate names.
  const std::optional<uint64_t>& own_engine_id() const { return own_engine_id_; }

 private:
  std::unique_ptr<TlsChannel> secure(int fd, SSL_CTX* ctx, bool client, double timeout_s) const;

  std::string psk_;
  std::optional<uint64_t> own_engine_id_;
  SSL_CTX* client_ = nullptr;
  SSL_CTX* server_ = nullptr;
};

// The engine id of the engine named `name` (its certificate's subject common name): the first
// 8 bytes, little-endian, of SHA-256("pddcore engine id v1\n" + name).
uint64_t engine_id_for_name(const std::string& name);

// Bytes per second one core seals (encrypts and tags) with TLS 1.3's AES-128-GCM, in
// 16 KiB records, over `total_bytes`: what a TLS sender's cipher alone could carry.
double aes_gcm_seal_rate(uint64_t total_bytes);

}  // namespace pddcore::transfer
