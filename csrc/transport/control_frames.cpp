#include "control_frames.h"

#include <stdexcept>

#include "framing.h"
#include "pddcore/crc32c.h"

namespace pddcore::transfer {

void send_control_frame(const Socket& s, wire::ControlType type, const std::string& payload) {
  if (payload.size() > wire::kMaxControlBytes)
    throw std::invalid_argument("control payload of " + std::to_string(payload.size()) + " bytes exceeds the " +
                                std::to_string(wire::kMaxControlBytes) + "-byte limit");
  wire::ControlHeader header;
  header.type = type;
  header.length = static_cast<uint32_t>(payload.size());
  header.crc = crc32c(payload.data(), payload.size());
  send_frame(s, header, payload);
}

bool recv_control_frame(const Socket& s, wire::ControlType* type, std::string* payload, bool idle_ok) {
  wire::ControlHeader header;
  if (!recv_frame(s, &header, payload, "control frame", idle_ok)) return false;
  if (crc32c(payload->data(), payload->size()) != header.crc) throw TransferError("control frame CRC mismatch");
  *type = header.type;
  return true;
}

}  // namespace pddcore::transfer
