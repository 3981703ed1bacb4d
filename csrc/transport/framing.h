// Length-prefixed frames on a Socket: a fixed-size header that encodes and decodes itself
// (wire::ControlHeader, rdma::setup::Header) followed by `length` payload bytes. The
// control connection and the RDMA setup connection both speak this shape.
#pragma once

#include <sys/uio.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "pddcore/transfer_backend.h"
#include "socket.h"

namespace pddcore::transfer {

// Writes header + payload with one sendv; header.length must equal payload.size().
template <class Header>
void send_frame(const Socket& s, const Header& header, const std::string& payload) {
  uint8_t header_bytes[Header::kSize];
  header.encode(header_bytes);
  iovec iov[2] = {{header_bytes, sizeof(header_bytes)}, {const_cast<char*>(payload.data()), payload.size()}};
  s.sendv_all(iov, 2);
}

// Reads one frame into *header and *payload; throws TransferError naming `what` when the
// header does not decode. idle_ok: returns false when the receive deadline passes before
// the first byte (an idle connection) instead of throwing.
template <class Header>
bool recv_frame(const Socket& s, Header* header, std::string* payload, const char* what, bool idle_ok = false) {
  uint8_t header_bytes[Header::kSize];
  if (idle_ok) {
    if (!s.recv_frame(header_bytes, sizeof(header_bytes))) return false;
  } else {
    s.recv_all(header_bytes, sizeof(header_bytes));
  }
  if (!header->decode(header_bytes)) throw TransferError(std::string("malformed ") + what);
  // The buffer grows as bytes arrive (doubling), never to the announced length up front: a
  // peer announcing the largest frame and sending nothing holds no more than kFirstPiece.
  constexpr size_t kFirstPiece = 4096;
  payload->clear();
  for (size_t got = 0; got < header->length;) {
    const size_t piece = std::min<size_t>(header->length - got, std::max(got, kFirstPiece));
    payload->resize(got + piece);
    s.recv_all(payload->data() + got, piece);
    got += piece;
  }
  return true;
}

}  // namespace pddcore::transfer
