// The ibverbs calls the RDMA backend makes, as a table of function pointers. Two fillers,
// both opened with dlopen: the system's libibverbs (so the module imports on machines
// without rdma-core), and the in-process verbs emulator (emulator/verbs_emulator.h), a
// test device for machines without an RDMA NIC. The backend calls verbs only through this table.
#pragma once

#include <infiniband/verbs.h>

#include <string>

namespace pddcore::rdma {

struct VerbsTable {
  const char* provider;  // "libibverbs" or "verbs emulator"

  ibv_device** (*get_device_list)(int* num_devices);
  void (*free_device_list)(ibv_device** list);
  const char* (*get_device_name)(ibv_device* device);
  ibv_context* (*open_device)(ibv_device* device);
  int (*close_device)(ibv_context* context);
  int (*query_port)(ibv_context* context, uint8_t port_num, ibv_port_attr* attr);
  int (*query_gid)(ibv_context* context, uint8_t port_num, int index, ibv_gid* gid);
  ibv_pd* (*alloc_pd)(ibv_context* context);
  int (*dealloc_pd)(ibv_pd* pd);
  ibv_mr* (*reg_mr)(ibv_pd* pd, void* addr, size_t length, int access);
  int (*dereg_mr)(ibv_mr* mr);
  ibv_cq* (*create_cq)(ibv_context* context, int cqe, void* cq_context, ibv_comp_channel* channel, int comp_vector);
  int (*destroy_cq)(ibv_cq* cq);
  ibv_qp* (*create_qp)(ibv_pd* pd, ibv_qp_init_attr* attr);
  int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask);
  int (*destroy_qp)(ibv_qp* qp);
  int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr);
  int (*post_recv)(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr);
  int (*poll_cq)(ibv_cq* cq, int num_entries, ibv_wc* wc);
  const char* (*wc_status_str)(ibv_wc_status status);
};

// The system's libibverbs.so.1, loaded once and kept for the process lifetime. Null, with
// the reason in *why, when the library or one of its symbols is missing.
const VerbsTable* system_verbs(std::string* why);
// The verbs emulator module installed next to pddcore._C, loaded once; null, with the
// reason in *why, when it is missing.
const VerbsTable* emulator_verbs(std::string* why);

}  // namespace pddcore::rdma
