// What the fuzz targets under tests/fuzz share. A target hands the fuzzer's input to the
// engine's own parser as a peer's bytes on a real connected socket, so the parser runs with
// the engine's receive path (partial reads, EOF midway); it checks what the parser returned
// against fields read from the input here, independently of csrc.
#pragma once

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>

#include "pddcore/transfer_backend.h"
#include "transport/socket.h"

// A failed check aborts: libFuzzer reports it as a crash and saves the input.
#define FUZZ_CHECK(cond)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "%s:%d: fuzz check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

namespace fuzz {

// A connected pair: the peer's end has sent `bytes` and closed its sending side before the
// parser under test reads `socket`, the other end (the input, at most the fuzzer's max_len,
// fits in the socket's buffer, so no thread has to feed it). What the parser sends back stays
// queued at the peer's end until replies().
class PeerBytes {
 public:
  PeerBytes(const uint8_t* bytes, size_t size) {
    int fds[2];
    FUZZ_CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
    socket = pddcore::transfer::Socket(fds[0]);
    peer_fd_ = fds[1];
    const ssize_t sent = size == 0 ? 0 : ::send(peer_fd_, bytes, size, MSG_DONTWAIT | MSG_NOSIGNAL);
    FUZZ_CHECK(sent == static_cast<ssize_t>(size));  // else the input outgrew the buffer: lower -max_len
    ::shutdown(peer_fd_, SHUT_WR);
  }
  PeerBytes(const PeerBytes&) = delete;
  PeerBytes& operator=(const PeerBytes&) = delete;
  ~PeerBytes() { ::close(peer_fd_); }

  // Everything the parser sent to the peer. Call after the parser returned: it closes the
  // parser's end first.
  std::string replies() {
    socket.shutdown();
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = ::recv(peer_fd_, buf, sizeof(buf), 0)) > 0;) out.append(buf, static_cast<size_t>(n));
    return out;
  }

  pddcore::transfer::Socket socket;

 private:
  int peer_fd_ = -1;
};

// Little-endian fields of the input, read without csrc's wire::Reader.
inline uint64_t le(const uint8_t* p, size_t bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// CRC32C bit by bit (reflected Castagnoli polynomial), independent of pddcore/crc32c.h.
inline uint32_t crc32c_bitwise(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}

}  // namespace fuzz
