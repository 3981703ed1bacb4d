#include "verbs_device.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>

#include "pddcore/transfer_backend.h"

namespace pddcore::rdma {
namespace {

using transfer::TransferError;

[[noreturn]] void no_device(const std::string& why) {
  throw TransferError("no usable RDMA device: " + why +
                      ". Backends usable on this machine: 'tcp', and 'rdma' with device='emulator' (the in-process "
                      "verbs emulator, for tests; or set PDDCORE_VERBS=emulator)");
}

std::string errno_text(const char* call, int err) { return std::string(call) + " failed: " + std::strerror(err); }

const VerbsTable& choose_verbs(const std::string& device) {
  const char* env = std::getenv("PDDCORE_VERBS");
  if (env != nullptr && *env != '\0' && std::strcmp(env, "emulator") != 0)
    throw std::invalid_argument(std::string("PDDCORE_VERBS must be 'emulator' or unset, not '") + env + "'");
  const bool emulated = device == "emulator" || (device.empty() && env != nullptr && std::strcmp(env, "emulator") == 0);
  std::string why;
  const VerbsTable* table = emulated ? emulator_verbs(&why) : system_verbs(&why);
  if (table == nullptr) no_device(why);
  return *table;
}

}  // namespace

VerbsDevice::VerbsDevice(const DeviceChoice& choice) : verbs_(&choose_verbs(choice.device)), port_num_(choice.ib_port) {
  const VerbsTable& v = *verbs_;
  int count = 0;
  errno = 0;
  ibv_device** list = v.get_device_list(&count);
  if (list == nullptr) no_device(errno_text("ibv_get_device_list", errno == 0 ? ENODEV : errno));
  ibv_device* chosen = nullptr;
  std::string names;
  for (int i = 0; i < count; ++i) {
    const char* name = v.get_device_name(list[i]);
    names += (names.empty() ? "" : ", ") + std::string(name);
    const bool wanted = choice.device.empty() || choice.device == "emulator" || choice.device == name;
    if (chosen == nullptr && wanted) chosen = list[i];
  }
  if (chosen == nullptr) {
    v.free_device_list(list);
    no_device(count == 0 ? std::string("ibv_get_device_list found no devices")
                         : "no device named '" + choice.device + "' (found: " + names + ")");
  }
  name_ = v.get_device_name(chosen);
  context_ = v.open_device(chosen);
  const int open_errno = errno;
  v.free_device_list(list);
  if (context_ == nullptr) no_device(errno_text(("ibv_open_device(" + name_ + ")").c_str(), open_errno));
  try {
    if (int rc = v.query_port(context_, port_num_, &port_); rc != 0)
      throw TransferError("RDMA device " + name_ + ": " +
                          errno_text(("ibv_query_port(port " + std::to_string(port_num_) + ")").c_str(), rc));
    if (port_.state != IBV_PORT_ACTIVE)
      throw TransferError("RDMA device " + name_ + " port " + std::to_string(port_num_) + " is not active");
    use_gid_ = choice.gid_index >= 0 || port_.link_layer == IBV_LINK_LAYER_ETHERNET;
    gid_index_ = std::max(choice.gid_index, 0);
    if (use_gid_) {
      if (int rc = v.query_gid(context_, port_num_, gid_index_, &gid_); rc != 0)
        throw TransferError("RDMA device " + name_ + ": " + errno_text("ibv_query_gid", rc));
    }
    pd_ = v.alloc_pd(context_);
    if (pd_ == nullptr) throw TransferError("RDMA device " + name_ + ": " + errno_text("ibv_alloc_pd", errno));
  } catch (...) {
    v.close_device(context_);
    throw;
  }
}

VerbsDevice::~VerbsDevice() {
  verbs_->dealloc_pd(pd_);
  verbs_->close_device(context_);
}

setup::QpAttributes VerbsDevice::local_address() const {
  setup::QpAttributes a;
  a.lid = port_.lid;
  a.mtu = static_cast<uint8_t>(port_.active_mtu);
  a.has_gid = use_gid_ ? 1 : 0;
  std::memcpy(a.gid, gid_.raw, sizeof(a.gid));
  return a;
}

QueuePair::QueuePair(const VerbsDevice& device, uint32_t max_send_wr, uint32_t max_recv_wr)
    : device_(device), max_send_wr_(max_send_wr) {
  const VerbsTable& v = device.verbs();
  cq_ = v.create_cq(device.context(), static_cast<int>(max_send_wr + max_recv_wr), nullptr, nullptr, 0);
  if (cq_ == nullptr) throw TransferError(errno_text("ibv_create_cq", errno));
  ibv_qp_init_attr init{};
  init.send_cq = init.recv_cq = cq_;
  init.qp_type = IBV_QPT_RC;
  init.sq_sig_all = 0;  // selective signaling
  init.cap.max_send_wr = max_send_wr;
  init.cap.max_recv_wr = max_recv_wr;
  init.cap.max_send_sge = 1;
  init.cap.max_recv_sge = 1;
  qp_ = v.create_qp(device.pd(), &init);
  if (qp_ == nullptr) {
    const int err = errno;
    v.destroy_cq(cq_);
    throw TransferError(errno_text("ibv_create_qp", err));
  }
  local_ = device.local_address();
  local_.qpn = qp_->qp_num;
  std::random_device rd;
  local_.psn = rd() & 0xFFFFFF;
}

QueuePair::~QueuePair() {
  const VerbsTable& v = device_.verbs();
  v.destroy_qp(qp_);
  v.destroy_cq(cq_);
}

void QueuePair::connect(const setup::QpAttributes& remote, double timeout_s, bool sends) {
  const VerbsTable& v = device_.verbs();
  auto modify = [&](ibv_qp_attr& a, int mask, const char* step) {
    if (int rc = v.modify_qp(qp_, &a, mask); rc != 0)
      throw TransferError(std::string("ibv_modify_qp to ") + step + " failed: " + std::strerror(rc));
  };
  ibv_qp_attr init{};
  init.qp_state = IBV_QPS_INIT;
  init.port_num = device_.port();
  init.qp_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  modify(init, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, "INIT");

  ibv_qp_attr rtr{};
  rtr.qp_state = IBV_QPS_RTR;
  rtr.path_mtu = static_cast<ibv_mtu>(std::min(local_.mtu, remote.mtu));
  rtr.dest_qp_num = remote.qpn;
  rtr.rq_psn = remote.psn;
  rtr.max_dest_rd_atomic = 1;
  rtr.min_rnr_timer = 12;  // 0.64 ms
  rtr.ah_attr.dlid = remote.lid;
  rtr.ah_attr.port_num = device_.port();
  if (remote.has_gid && local_.has_gid) {
    rtr.ah_attr.is_global = 1;
    std::memcpy(rtr.ah_attr.grh.dgid.raw, remote.gid, sizeof(remote.gid));
    rtr.ah_attr.grh.sgid_index = static_cast<uint8_t>(device_.gid_index());
    rtr.ah_attr.grh.hop_limit = 64;
  }
  modify(rtr,
         IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
             IBV_QP_MIN_RNR_TIMER,
         "RTR");
  if (!sends) return;  // a target QP only receives: RTR suffices

  // retry_cnt 7 gives 8 tries of 4.096 us * 2^timeout each, 2 to 4 times timeout_s in
  // all: the engine's own no-progress deadline (timeout_s) speaks first, the NIC's
  // "retry counter exceeded" is the backstop.
  const double per_try = std::max(timeout_s, 0.01) / 4.0;
  const int exponent = static_cast<int>(std::ceil(std::log2(per_try / 4.096e-6)));
  ibv_qp_attr rts{};
  rts.qp_state = IBV_QPS_RTS;
  rts.sq_psn = local_.psn;
  rts.timeout = static_cast<uint8_t>(std::clamp(exponent, 1, 30));
  rts.retry_cnt = 7;
  rts.rnr_retry = 7;  // the receiver reposts receives as they are consumed
  rts.max_rd_atomic = 1;
  modify(rts,
         IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC,
         "RTS");
}

void QueuePair::post_receives(uint32_t n) {
  for (uint32_t i = 0; i < n; ++i) {
    ibv_recv_wr wr{}, *bad = nullptr;
    if (int rc = device_.verbs().post_recv(qp_, &wr, &bad); rc != 0)
      throw TransferError(std::string("ibv_post_recv failed: ") + std::strerror(rc));
  }
}

}  // namespace pddcore::rdma
