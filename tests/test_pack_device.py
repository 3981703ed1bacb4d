"""The CUDA pack launchers run on the device that owns the layout.

A raw stream handle names a stream of the *current* device, so every CUDA entry point in
csrc/kv/pack_cuda.cu holds a DeviceGuard for the layout's device. The guard's logic runs
here against a runtime that records device switches; tests/test_pack_cuda.py checks the
launches on a GPU (a non-default stream, and a device other than 0 when there is one).
"""

from __future__ import annotations

import cpp_unit

test_device_guard = cpp_unit.case_test(
    "device_guard_test", ["tests/cpp/device_guard_test.cpp"],
    ["switches_to_the_layout_device_and_back", "leaves_the_current_device_alone", "restores_when_the_launch_throws",
     "nested_guards_unwind_in_order"])
