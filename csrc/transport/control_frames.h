// Frames of the engine's control connection: a wire::ControlHeader whose CRC32C covers
// the payload, so a corrupted message or notification is refused, never delivered.
#pragma once

#include <string>

#include "pddcore/wire.h"
#include "socket.h"

namespace pddcore::transfer {

// Throws std::invalid_argument beyond wire::kMaxControlBytes, TransferError when sending fails.
void send_control_frame(const Socket& s, wire::ControlType type, const std::string& payload);

// Reads one frame; throws TransferError when it is malformed or fails its CRC. idle_ok:
// returns false when the connection stays idle past its receive deadline.
bool recv_control_frame(const Socket& s, wire::ControlType* type, std::string* payload, bool idle_ok = false);

}  // namespace pddcore::transfer
