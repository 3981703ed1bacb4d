// Makes one CUDA device current for a scope and restores the caller's on exit. A raw
// stream handle (0 above all, the legacy default stream) means "that stream of the
// current device", so every launcher that takes one must first make its layout's device
// current: otherwise a decode rank on GPU 3 launches on GPU 0 over GPU 3's memory.
//
// `Runtime` provides static `int current()` and `void set(int)` that throw on error
// (the CUDA launcher wraps cudaGetDevice / cudaSetDevice; the unit test records calls).
#pragma once

namespace pddcore::kv {

template <typename Runtime>
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : previous_(Runtime::current()), device_(device) {
    if (previous_ != device_) Runtime::set(device_);
  }
  ~DeviceGuard() {
    if (previous_ != device_) Runtime::set(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  const int previous_;
  const int device_;
};

}  // namespace pddcore::kv
