// One-byte flags on the wire (the challenge's auth_required, a QP's has_gid) are 0 or 1;
// any other byte makes the frame malformed. Built and run by tests/test_transfer_security.py;
// `wire_flags_test <case>`, exit 0 on success.
#include <cstdint>
#include <string>
#include <vector>

#include "check.h"
#include "pddcore/wire.h"
#include "transport/rdma/rdma_wire.h"

namespace wire = pddcore::wire;
namespace setup = pddcore::rdma::setup;

namespace {

void challenge_auth_required_is_a_flag() {
  for (int value = 0; value < 256; ++value) {
    wire::Challenge sent;
    sent.auth_required = static_cast<uint8_t>(value);
    uint8_t bytes[wire::Challenge::kSize];
    sent.encode(bytes);
    wire::Challenge got;
    CHECK(got.decode(bytes) == (value <= 1));
  }
}

void qp_has_gid_is_a_flag() {
  for (int value = 0; value < 256; ++value) {
    std::vector<setup::QpAttributes> qps(2);
    qps[1].has_gid = static_cast<uint8_t>(value);
    qps[1].qpn = 77;
    const std::vector<setup::QpAttributes> got = setup::decode_qps(setup::encode_qps(qps));
    CHECK(got.size() == (value <= 1 ? 2u : 0u));
    if (value <= 1) CHECK(got[1].qpn == 77 && got[1].has_gid == value);
  }
}

}  // namespace

int main(int argc, char** argv) {
  return run_case_main(argc, argv,
                       {{"challenge_auth_required_is_a_flag", challenge_auth_required_is_a_flag},
                        {"qp_has_gid_is_a_flag", qp_has_gid_is_a_flag}});
}
