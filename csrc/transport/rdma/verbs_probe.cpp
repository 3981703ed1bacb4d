#include "verbs_probe.h"

#include <dlfcn.h>

#include <cerrno>
#include <cstring>

namespace pddcore::rdma {

VerbsProbe probe_verbs() {
  VerbsProbe out;
  void* lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    out.detail = std::string("libibverbs not loadable: ") + dlerror();
    return out;
  }
  out.library_loaded = true;
  using GetList = void** (*)(int*);
  using FreeList = void (*)(void**);
  auto get_list = reinterpret_cast<GetList>(dlsym(lib, "ibv_get_device_list"));
  auto free_list = reinterpret_cast<FreeList>(dlsym(lib, "ibv_free_device_list"));
  if (get_list == nullptr || free_list == nullptr) {
    out.detail = "libibverbs lacks ibv_get_device_list";
  } else {
    errno = 0;
    void** list = get_list(&out.device_count);
    if (list == nullptr) {
      // ENOSYS: the kernel has no RDMA subsystem; common on machines without a NIC.
      out.device_count = 0;
      out.detail = std::string("ibv_get_device_list: ") + std::strerror(errno);
    } else {
      if (out.device_count == 0) out.detail = "no RDMA devices";
      free_list(list);
    }
  }
  dlclose(lib);
  return out;
}

}  // namespace pddcore::rdma
