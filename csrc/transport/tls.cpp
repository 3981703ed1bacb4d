#include "tls.h"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace pddcore::transfer {

namespace {

constexpr char kPskIdentity[] = "pddcore";
constexpr char kPskLabel[] = "pddcore tls 1.3 pre-shared key v1";
constexpr char kEngineIdLabel[] = "pddcore engine id v1\n";
// A TLS record carries at most 16 KiB: smaller pieces are gathered into one record.
constexpr size_t kRecordBytes = 16 << 10;
constexpr size_t kReadAheadBytes = 256 << 10;
constexpr long kWriteBufferBytes = 256 << 10;

std::string openssl_reason() {
  const unsigned long code = ERR_get_error();
  if (code == 0) return "unknown TLS error";
  char text[256];
  ERR_error_string_n(code, text, sizeof(text));
  return text;
}

const TlsContext& context_of(SSL* ssl) {
  return *static_cast<const TlsContext*>(SSL_CTX_get_app_data(SSL_get_SSL_CTX(ssl)));
}

unsigned int copy_psk(SSL* ssl, unsigned char* psk, unsigned int max_len) {
  const std::string& key = context_of(ssl).psk();
  if (key.size() > max_len) return 0;
  std::memcpy(psk, key.data(), key.size());
  return static_cast<unsigned int>(key.size());
}

unsigned int client_psk(SSL* ssl, const char*, char* identity, unsigned int max_identity, unsigned char* psk,
                        unsigned int max_psk) {
  if (sizeof(kPskIdentity) > max_identity) return 0;
  std::memcpy(identity, kPskIdentity, sizeof(kPskIdentity));
  return copy_psk(ssl, psk, max_psk);
}

unsigned int server_psk(SSL* ssl, const char* identity, unsigned char* psk, unsigned int max_psk) {
  if (identity == nullptr || std::strcmp(identity, kPskIdentity) != 0) return 0;
  return copy_psk(ssl, psk, max_psk);
}

// The subject common name of a certificate ("" without one).
std::string common_name(X509* cert) {
  char name[256] = {};
  const int n = X509_NAME_get_text_by_NID(X509_get_subject_name(cert), NID_commonName, name, sizeof(name));
  return n > 0 ? std::string(name, static_cast<size_t>(n)) : std::string();
}

// The certificate's engine id; throws std::invalid_argument naming `whose` without a common name.
uint64_t certified_id(X509* cert, const std::string& whose) {
  const std::string name = common_name(cert);
  if (name.empty()) throw std::invalid_argument(whose + " certificate has no subject common name (the engine's name)");
  return engine_id_for_name(name);
}

// Checks that our own certificate verifies against the CA now (not expired, not another
// CA's): otherwise every peer would refuse it with nothing but a TLS alert.
void verify_own_certificate(SSL_CTX* ctx, const std::string& cert_file) {
  X509_STORE_CTX* check = X509_STORE_CTX_new();
  STACK_OF(X509)* chain = nullptr;
  SSL_CTX_get0_chain_certs(ctx, &chain);
  const bool ok = check != nullptr &&
                  X509_STORE_CTX_init(check, SSL_CTX_get_cert_store(ctx), SSL_CTX_get0_certificate(ctx), chain) == 1 &&
                  X509_verify_cert(check) == 1;
  const std::string why = check != nullptr ? X509_verify_cert_error_string(X509_STORE_CTX_get_error(check)) : "";
  X509_STORE_CTX_free(check);
  if (!ok) throw std::invalid_argument("certificate " + cert_file + " does not verify against the CA: " + why);
}

void load_certificates(SSL_CTX* ctx, const TlsCertificates& files) {
  if (SSL_CTX_use_certificate_chain_file(ctx, files.cert_file.c_str()) != 1)
    throw std::invalid_argument("cannot read the certificate " + files.cert_file + ": " + openssl_reason());
  // Also checks that the key is the certificate's.
  if (SSL_CTX_use_PrivateKey_file(ctx, files.key_file.c_str(), SSL_FILETYPE_PEM) != 1)
    throw std::invalid_argument("cannot use the private key " + files.key_file + " with the certificate " +
                                files.cert_file + ": " + openssl_reason());
  if (SSL_CTX_load_verify_locations(ctx, files.ca_file.c_str(), nullptr) != 1)
    throw std::invalid_argument("cannot read the CA certificate " + files.ca_file + ": " + openssl_reason());
  verify_own_certificate(ctx, files.cert_file);
  // Both ends present a certificate and verify the other's chain against the CA.
  SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, nullptr);
}

SSL_CTX* make_context(bool client, TlsContext* owner, const TlsCertificates* certificates) {
  SSL_CTX* ctx = SSL_CTX_new(client ? TLS_client_method() : TLS_server_method());
  if (ctx == nullptr) throw TlsError("SSL_CTX_new failed: " + openssl_reason());
  SSL_CTX_set_app_data(ctx, owner);
  // TLS 1.3 only; an external PSK through these callbacks needs a SHA-256 suite.
  SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION);
  SSL_CTX_set_ciphersuites(ctx, "TLS_AES_128_GCM_SHA256");
  SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
  // Read whatever the kernel holds in one recv (many records), not one record per syscall.
  SSL_CTX_set_read_ahead(ctx, 1);
  SSL_CTX_set_default_read_buffer_len(ctx, kReadAheadBytes);
  if (!client) SSL_CTX_set_num_tickets(ctx, 0);  // no resumption: every connection proves its key afresh
  if (certificates != nullptr) {
    try {
      load_certificates(ctx, *certificates);
    } catch (...) {
      SSL_CTX_free(ctx);
      throw;
    }
  } else if (client) {
    SSL_CTX_set_psk_client_callback(ctx, client_psk);
  } else {
    SSL_CTX_set_psk_server_callback(ctx, server_psk);
  }
  return ctx;
}

double seconds_left(int64_t deadline_ns) { return static_cast<double>(deadline_ns - now_ns()) / 1e9; }

}  // namespace

// ---- channel ---------------------------------------------------------------

TlsChannel::TlsChannel(SSL* ssl, int fd, double recv_timeout_s, double send_timeout_s)
    : ssl_(ssl), fd_(fd), recv_timeout_s_(recv_timeout_s), send_timeout_s_(send_timeout_s) {}

TlsChannel::~TlsChannel() { SSL_free(ssl_); }

void TlsChannel::set_timeouts(double recv_s, double send_s) {
  recv_timeout_s_ = recv_s;
  send_timeout_s_ = send_s;
}

bool TlsChannel::wait(Want want, double timeout_s) const {
  pollfd pfd{fd_, static_cast<short>(want == Want::kRead ? POLLIN : POLLOUT), 0};
  const int ms = timeout_s > 0 ? std::max(1, static_cast<int>(timeout_s * 1000)) : -1;
  for (;;) {
    const int ready = ::poll(&pfd, 1, ms);
    if (ready > 0) return true;
    if (ready == 0) return false;
    if (errno != EINTR) throw TransferError(std::string("poll failed: ") + std::strerror(errno));
  }
}

size_t TlsChannel::read(void* data, size_t n, bool dont_wait) {
  const double timeout = recv_timeout_s_;
  const int64_t deadline = now_ns() + static_cast<int64_t>(timeout * 1e9);
  for (;;) {
    int err;
    std::string reason;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ERR_clear_error();
      size_t got = 0;
      if (!broken_.empty()) throw TlsError(broken_);
      if (SSL_read_ex(ssl_, data, n, &got) == 1) {
        // Records already read ahead decrypt straight on: one call takes what has arrived.
        size_t more = 0;
        while (got < n && SSL_has_pending(ssl_)) {
          if (SSL_read_ex(ssl_, static_cast<uint8_t*>(data) + got, n - got, &more) == 1) {
            got += more;
          } else {
            // What came before is authentic and returned; a rejected record fails the next read.
            if (SSL_get_error(ssl_, 0) == SSL_ERROR_SSL) broken_ = "TLS record rejected: " + openssl_reason();
            break;
          }
        }
        ERR_clear_error();
        return got;
      }
      err = SSL_get_error(ssl_, 0);
      if (err == SSL_ERROR_SSL) reason = openssl_reason();
    }
    switch (err) {
      case SSL_ERROR_WANT_READ:
      case SSL_ERROR_WANT_WRITE: {  // 0 ("nothing yet") when the receive timeout passes first
        if (dont_wait && err == SSL_ERROR_WANT_READ) return 0;
        const double left = timeout > 0 ? seconds_left(deadline) : 0;
        if (timeout > 0 && left <= 0) return 0;
        if (!wait(err == SSL_ERROR_WANT_READ ? Want::kRead : Want::kWrite, left)) return 0;
        break;
      }
      case SSL_ERROR_ZERO_RETURN:
      case SSL_ERROR_SYSCALL:
        throw TransferError("connection closed by peer");
      default:
        throw TlsError("TLS record rejected: " + reason);
    }
  }
}

size_t TlsChannel::readv(iovec* iov, int count) {
  size_t total = read(iov[0].iov_base, iov[0].iov_len, false);
  if (total == 0) throw TransferError("receive timed out");
  for (int i = 1; i < count && total == iov[0].iov_len; ++i) {
    const size_t got = read(iov[i].iov_base, iov[i].iov_len, true);
    if (got == 0) break;
    total += got;
    if (got < iov[i].iov_len) break;
  }
  return total;
}

void TlsChannel::write(const iovec* iov, int count) {
  std::vector<uint8_t> gathered;  // small pieces share a record instead of paying one each
  const auto send_bytes = [this](const uint8_t* p, size_t left) {
    while (left > 0) {
      int err;
      std::string reason;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ERR_clear_error();
        size_t written = 0;
        if (SSL_write_ex(ssl_, p, left, &written) == 1) {
          p += written;
          left -= written;
          continue;
        }
        err = SSL_get_error(ssl_, 0);
        if (err == SSL_ERROR_SSL) reason = openssl_reason();
      }
      if (err == SSL_ERROR_WANT_WRITE || err == SSL_ERROR_WANT_READ) {
        if (!wait(err == SSL_ERROR_WANT_WRITE ? Want::kWrite : Want::kRead, send_timeout_s_))
          throw TransferError("send timed out (peer not reading)");
      } else if (err == SSL_ERROR_SYSCALL || err == SSL_ERROR_ZERO_RETURN) {
        throw TransferError("connection closed by peer");
      } else {
        throw TlsError("TLS write failed: " + reason);
      }
    }
  };
  const auto flush = [&] {
    send_bytes(gathered.data(), gathered.size());
    gathered.clear();
  };
  for (int i = 0; i < count; ++i) {
    const auto* p = static_cast<const uint8_t*>(iov[i].iov_base);
    const size_t n = iov[i].iov_len;
    if (n >= kRecordBytes) {
      flush();
      send_bytes(p, n);
    } else {
      if (gathered.size() + n > kRecordBytes) flush();
      gathered.insert(gathered.end(), p, p + n);
    }
  }
  flush();
  for (;;) {  // push the buffered records to the socket
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (BIO_flush(SSL_get_wbio(ssl_)) == 1) return;
      if (!BIO_should_retry(SSL_get_wbio(ssl_))) throw TransferError("connection closed by peer");
    }
    if (!wait(Want::kWrite, send_timeout_s_)) throw TransferError("send timed out (peer not reading)");
  }
}

// ---- identities ------------------------------------------------------------

uint64_t engine_id_for_name(const std::string& name) {
  const std::string labelled = kEngineIdLabel + name;
  uint8_t digest[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const uint8_t*>(labelled.data()), labelled.size(), digest);
  uint64_t id = 0;
  for (int i = 7; i >= 0; --i) id = (id << 8) | digest[i];
  return id;
}

// ---- cipher rate -----------------------------------------------------------

double aes_gcm_seal_rate(uint64_t total_bytes) {
  std::vector<uint8_t> plain(kRecordBytes, 0x5a), sealed(kRecordBytes + 16);
  uint8_t key[16] = {1}, iv[12] = {2}, tag[16];
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  if (ctx == nullptr || EVP_EncryptInit_ex(ctx, EVP_aes_128_gcm(), nullptr, key, iv) != 1) {
    EVP_CIPHER_CTX_free(ctx);
    throw TlsError("AES-128-GCM is not available in OpenSSL");
  }
  const int64_t start = now_ns();
  for (uint64_t done = 0; done < total_bytes; done += kRecordBytes) {
    ++iv[11];  // a fresh nonce per record, as TLS does
    int n = 0;
    EVP_EncryptInit_ex(ctx, nullptr, nullptr, nullptr, iv);
    EVP_EncryptUpdate(ctx, sealed.data(), &n, plain.data(), static_cast<int>(plain.size()));
    EVP_EncryptFinal_ex(ctx, sealed.data() + n, &n);
    EVP_CIPHER_CTX_ctrl(ctx, EVP_CTRL_GCM_GET_TAG, sizeof(tag), tag);
  }
  const double seconds = static_cast<double>(now_ns() - start) / 1e9;
  EVP_CIPHER_CTX_free(ctx);
  return static_cast<double>(total_bytes) / seconds;
}

// ---- context ---------------------------------------------------------------

TlsContext::TlsContext(const std::string& auth_token) {
  if (auth_token.empty()) throw std::invalid_argument("TLS needs an auth token: its pre-shared key comes from it");
  uint8_t key[32];
  unsigned int len = sizeof(key);
  if (HMAC(EVP_sha256(), auth_token.data(), static_cast<int>(auth_token.size()),
           reinterpret_cast<const uint8_t*>(kPskLabel), sizeof(kPskLabel) - 1, key, &len) == nullptr)
    throw TlsError("HMAC-SHA256 failed in OpenSSL");
  psk_.assign(reinterpret_cast<const char*>(key), len);
  client_ = make_context(true, this, nullptr);
  server_ = make_context(false, this, nullptr);
}

TlsContext::TlsContext(const TlsCertificates& certificates) {
  if (certificates.ca_file.empty() || certificates.cert_file.empty() || certificates.key_file.empty())
    throw std::invalid_argument("TLS with certificates needs a CA file, a certificate file and a key file");
  client_ = make_context(true, this, &certificates);
  try {
    server_ = make_context(false, this, &certificates);
  } catch (...) {
    SSL_CTX_free(client_);
    throw;
  }
  own_engine_id_ = certified_id(SSL_CTX_get0_certificate(client_), "this engine's");
}

TlsContext::~TlsContext() {
  SSL_CTX_free(client_);
  SSL_CTX_free(server_);
}

std::unique_ptr<TlsChannel> TlsContext::secure_client(int fd, double timeout_s) const {
  return secure(fd, client_, true, timeout_s);
}
std::unique_ptr<TlsChannel> TlsContext::secure_server(int fd, double timeout_s) const {
  return secure(fd, server_, false, timeout_s);
}

std::unique_ptr<TlsChannel> TlsContext::secure(int fd, SSL_CTX* ctx, bool client, double timeout_s) const {
  SSL* ssl = SSL_new(ctx);
  if (ssl == nullptr) throw TlsError("SSL_new failed: " + openssl_reason());
  auto channel = std::make_unique<TlsChannel>(ssl, fd, timeout_s, timeout_s);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  // Records leave through a 256 KiB buffer, flushed at the end of each write: one syscall
  // carries many 16 KiB records instead of one each.
  BIO* socket_bio = BIO_new_socket(fd, BIO_NOCLOSE);
  BIO* buffered = BIO_new(BIO_f_buffer());
  if (socket_bio == nullptr || buffered == nullptr || BIO_set_write_buffer_size(buffered, kWriteBufferBytes) != 1) {
    BIO_free(socket_bio);
    BIO_free(buffered);
    throw TlsError("cannot set up the TLS socket BIO: " + openssl_reason());
  }
  BIO_up_ref(socket_bio);
  SSL_set_bio(ssl, socket_bio, BIO_push(buffered, socket_bio));
  const int64_t deadline = now_ns() + static_cast<int64_t>(timeout_s * 1e9);
  for (;;) {
    ERR_clear_error();
    const int r = client ? SSL_connect(ssl) : SSL_accept(ssl);
    if (r == 1) break;
    const int err = SSL_get_error(ssl, r);
    const double left = seconds_left(deadline);
    if (left <= 0) throw TlsError("TLS handshake timed out");
    if (err == SSL_ERROR_WANT_READ || err == SSL_ERROR_WANT_WRITE) {
      pollfd pfd{fd, static_cast<short>(err == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), 0};
      ::poll(&pfd, 1, std::max(1, static_cast<int>(left * 1000)));
      continue;
    }
    const long verified = SSL_get_verify_result(ssl);
    const std::string why = verified != X509_V_OK ? std::string("peer certificate: ") +
                                                        X509_verify_cert_error_string(verified)
                            : err == SSL_ERROR_SSL ? openssl_reason()
                                                   : std::string("connection closed");
    throw TlsError(own_engine_id_ ? "TLS handshake failed (does the peer hold a certificate from the same CA?): " + why
                                  : "TLS handshake failed (is TLS on at both ends, with the same auth token?): " + why);
  }
  if (own_engine_id_) {
    // The handshake verified the chain; the name on it is the peer's identity.
    X509* peer = SSL_get0_peer_certificate(ssl);
    if (peer == nullptr) throw TlsError("peer presented no certificate");
    try {
      channel->certified_peer_id_ = certified_id(peer, "the peer's");
    } catch (const std::invalid_argument& e) {
      throw TlsError(e.what());
    }
  }
  return channel;
}

}  // namespace pddcore::transfer
