// DeviceGuard (csrc/kv/device_guard.h) against a runtime that records every device switch.
#include <stdexcept>
#include <vector>

#include "check.h"
#include "kv/device_guard.h"

namespace {

struct RecordingRuntime {
  static inline int device = 0;
  static inline std::vector<int> sets;
  static int current() { return device; }
  static void set(int d) {
    sets.push_back(d);
    device = d;
  }
  static void reset(int d) {
    device = d;
    sets.clear();
  }
};
using Guard = pddcore::kv::DeviceGuard<RecordingRuntime>;

void switches_to_the_layout_device_and_back() {
  RecordingRuntime::reset(0);
  {
    Guard guard(3);
    CHECK(RecordingRuntime::device == 3);
  }
  CHECK(RecordingRuntime::device == 0);
  CHECK((RecordingRuntime::sets == std::vector<int>{3, 0}));
}

void leaves_the_current_device_alone() {
  RecordingRuntime::reset(2);
  {
    Guard guard(2);
    CHECK(RecordingRuntime::device == 2);
  }
  CHECK(RecordingRuntime::sets.empty());
}

void restores_when_the_launch_throws() {
  RecordingRuntime::reset(1);
  try {
    Guard guard(0);
    throw std::runtime_error("launch failed");
  } catch (const std::runtime_error&) {
  }
  CHECK(RecordingRuntime::device == 1);
  CHECK((RecordingRuntime::sets == std::vector<int>{0, 1}));
}

void nested_guards_unwind_in_order() {
  RecordingRuntime::reset(0);
  {
    Guard outer(1);
    {
      Guard inner(2);
      CHECK(RecordingRuntime::device == 2);
    }
    CHECK(RecordingRuntime::device == 1);
  }
  CHECK(RecordingRuntime::device == 0);
}

}  // namespace

int main(int argc, char** argv) {
  return run_case_main(argc, argv,
                       {{"switches_to_the_layout_device_and_back", switches_to_the_layout_device_and_back},
                        {"leaves_the_current_device_alone", leaves_the_current_device_alone},
                        {"restores_when_the_launch_throws", restores_when_the_launch_throws},
                        {"nested_guards_unwind_in_order", nested_guards_unwind_in_order}});
}
