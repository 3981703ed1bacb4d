#include "verbs_table.h"

#include <dlfcn.h>

#include <mutex>

namespace pddcore::rdma {
namespace {

struct SystemLibrary {
  VerbsTable table{};
  std::string error;
  // ibv_query_port is a header inline that prefers the provider's extended op and falls
  // back to this exported compat symbol.
  int (*compat_query_port)(ibv_context*, uint8_t, _compat_ibv_port_attr*) = nullptr;
};

SystemLibrary& library() {
  static SystemLibrary lib;
  return lib;
}

int query_port_thunk(ibv_context* context, uint8_t port_num, ibv_port_attr* attr) {
  verbs_context* vctx = verbs_get_ctx_op(context, query_port);
  if (vctx != nullptr) return vctx->query_port(context, port_num, attr, sizeof(*attr));
  *attr = ibv_port_attr{};
  return library().compat_query_port(context, port_num, reinterpret_cast<_compat_ibv_port_attr*>(attr));
}

// The data-path calls are header inlines that dispatch through the provider's context ops.
int post_send_thunk(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad_wr) {
  return qp->context->ops.post_send(qp, wr, bad_wr);
}
int post_recv_thunk(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad_wr) {
  return qp->context->ops.post_recv(qp, wr, bad_wr);
}
int poll_cq_thunk(ibv_cq* cq, int num_entries, ibv_wc* wc) { return cq->context->ops.poll_cq(cq, num_entries, wc); }

template <typename Fn>
bool bind(void* handle, const char* name, Fn* out, std::string* error) {
  *out = reinterpret_cast<Fn>(dlsym(handle, name));
  if (*out == nullptr && error->empty()) *error = std::string("libibverbs lacks ") + name;
  return *out != nullptr;
}

void load(SystemLibrary& lib) {
  void* h = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    lib.error = std::string("libibverbs not loadable: ") + dlerror();
    return;
  }
  VerbsTable& t = lib.table;
  t.provider = "libibverbs";
  std::string& e = lib.error;
  bind(h, "ibv_get_device_list", &t.get_device_list, &e);
  bind(h, "ibv_free_device_list", &t.free_device_list, &e);
  bind(h, "ibv_get_device_name", &t.get_device_name, &e);
  bind(h, "ibv_open_device", &t.open_device, &e);
  bind(h, "ibv_close_device", &t.close_device, &e);
  bind(h, "ibv_query_port", &lib.compat_query_port, &e);
  bind(h, "ibv_query_gid", &t.query_gid, &e);
  bind(h, "ibv_alloc_pd", &t.alloc_pd, &e);
  bind(h, "ibv_dealloc_pd", &t.dealloc_pd, &e);
  bind(h, "ibv_reg_mr", &t.reg_mr, &e);
  bind(h, "ibv_dereg_mr", &t.dereg_mr, &e);
  bind(h, "ibv_create_cq", &t.create_cq, &e);
  bind(h, "ibv_destroy_cq", &t.destroy_cq, &e);
  bind(h, "ibv_create_qp", &t.create_qp, &e);
  bind(h, "ibv_modify_qp", &t.modify_qp, &e);
  bind(h, "ibv_destroy_qp", &t.destroy_qp, &e);
  bind(h, "ibv_wc_status_str", &t.wc_status_str, &e);
  t.query_port = query_port_thunk;
  t.post_send = post_send_thunk;
  t.post_recv = post_recv_thunk;
  t.poll_cq = poll_cq_thunk;
  // The handle stays open: MRs and QPs may outlive any one backend.
}

}  // namespace

const VerbsTable* system_verbs(std::string* why) {
  static std::once_flag once;
  SystemLibrary& lib = library();
  std::call_once(once, [&] { load(lib); });
  if (!lib.error.empty()) {
    if (why != nullptr) *why = lib.error;
    return nullptr;
  }
  return &lib.table;
}

const VerbsTable* emulator_verbs(std::string* why) {
  static const VerbsTable* table = nullptr;
  static std::string error;
  static std::once_flag once;
  std::call_once(once, [] {
    // The module lies in the directory of the library this code is part of (pddcore._C).
    Dl_info self{};
    if (dladdr(reinterpret_cast<const void*>(&emulator_verbs), &self) == 0 || self.dli_fname == nullptr) {
      error = "cannot locate pddcore._C to find the verbs emulator next to it";
      return;
    }
    std::string path = self.dli_fname;
    path = path.substr(0, path.rfind('/') + 1) + PDDCORE_VERBS_EMULATOR_FILE;
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) {
      error = std::string("the verbs emulator is not loadable: ") + dlerror();
      return;
    }
    using TableFn = const VerbsTable* (*)();
    auto fn = reinterpret_cast<TableFn>(dlsym(h, "pddcore_verbs_emulator_table"));
    if (fn == nullptr) {
      error = path + " lacks pddcore_verbs_emulator_table";
      return;
    }
    table = fn();
  });
  if (table == nullptr && why != nullptr) *why = error;
  return table;
}

}  // namespace pddcore::rdma
