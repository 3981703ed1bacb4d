// Owning wrappers around the verbs objects the RDMA backend uses: the opened device with
// its protection domain, and a queue pair with its completion queue. All calls go
// through a VerbsTable, so the same code drives a NIC or the verbs emulator.
#pragma once

#include <cstdint>
#include <string>

#include "rdma_wire.h"
#include "verbs_table.h"

namespace pddcore::rdma {

struct DeviceChoice {
  // "" picks the first device of the system's libibverbs, or the verbs emulator when the
  // environment says PDDCORE_VERBS=emulator; "emulator" picks the emulator explicitly;
  // anything else names a device (e.g. "mlx5_0").
  std::string device;
  uint8_t ib_port = 1;
  int gid_index = -1;  // -1: no GRH on InfiniBand, GID 0 on RoCE
};

class VerbsDevice {
 public:
  // Throws TransferError when no device can be opened: the message says why and which
  // backends are usable on this machine.
  explicit VerbsDevice(const DeviceChoice& choice);
  ~VerbsDevice();
  VerbsDevice(const VerbsDevice&) = delete;
  VerbsDevice& operator=(const VerbsDevice&) = delete;

  const VerbsTable& verbs() const { return *verbs_; }
  ibv_pd* pd() const { return pd_; }
  ibv_context* context() const { return context_; }
  const std::string& name() const { return name_; }
  uint8_t port() const { return port_num_; }
  int gid_index() const { return gid_index_; }
  // This port's address for a QP: LID, GID when one is used, active MTU.
  setup::QpAttributes local_address() const;

 private:
  const VerbsTable* verbs_ = nullptr;
  ibv_context* context_ = nullptr;
  ibv_pd* pd_ = nullptr;
  std::string name_;
  uint8_t port_num_ = 1;
  ibv_port_attr port_{};
  bool use_gid_ = false;
  int gid_index_ = 0;
  ibv_gid gid_{};
};

// An RC queue pair with its own completion queue (sends and receives).
class QueuePair {
 public:
  QueuePair(const VerbsDevice& device, uint32_t max_send_wr, uint32_t max_recv_wr);
  ~QueuePair();
  QueuePair(const QueuePair&) = delete;
  QueuePair& operator=(const QueuePair&) = delete;

  ibv_qp* qp() const { return qp_; }
  ibv_cq* cq() const { return cq_; }
  uint32_t max_send_wr() const { return max_send_wr_; }
  // Our side of the connection, with a fresh random starting PSN.
  const setup::QpAttributes& local() const { return local_; }
  // RESET -> INIT -> RTR against the peer's attributes, then to RTS when this side sends;
  // the ACK timeout is chosen so that retry_cnt + 1 timeouts last 2-4 x timeout_s.
  // Throws TransferError.
  void connect(const setup::QpAttributes& remote, double timeout_s, bool sends);
  // Posts n receives for RDMA_WRITE_WITH_IMM (no buffers: the immediate carries the news).
  void post_receives(uint32_t n);

 private:
  const VerbsDevice& device_;
  ibv_cq* cq_ = nullptr;
  ibv_qp* qp_ = nullptr;
  uint32_t max_send_wr_;
  setup::QpAttributes local_;
};

}  // namespace pddcore::rdma
