"""The TCP backend's delivery meter (stats' ``path_limited_bytes`` / ``path_limited_seconds``,
what the router's bandwidth estimator reads): the integration of the kernel's delivery-rate
samples tested in C++ against hand-made TCP_INFO readings (tests/cpp/delivery_meter_test.cpp:
acknowledged bytes counted, never rate samples, the gaps between bunches of acks counted,
and a repair's stall, a streaming sender's waits and the time after a transfer left out, idle and application-limited connections left out, a reconnect is
a new baseline), and live counters on loopback. Through
a real bottleneck with a streaming sender: tests/test_transfer_wan.py (root)."""

from __future__ import annotations

import time

import torch

import cpp_unit
from pddcore.transfer import TransferEngine

METER_CASES = ["sums_the_connections", "streaming_waits_do_not_count", "idle_connection_is_left_out",
               "application_limited_samples_say_nothing", "reconnect_is_a_new_baseline",
               "counts_acknowledged_bytes_not_rate_samples", "acks_in_bunches_count_the_time_between",
               "a_stall_while_data_is_outstanding_counts",
               "the_time_after_the_last_delivery_does_not_count",
               "late_reading_is_dropped_and_silence_says_nothing"]


test_delivery_meter = cpp_unit.case_test("delivery_meter_test", ["tests/cpp/delivery_meter_test.cpp",
                                                               "csrc/transport/tcp/delivery_meter.cpp"], METER_CASES)


def test_bulk_write_on_loopback_is_path_limited_and_idle_time_is_not():
    nbytes = 64 << 20
    with TransferEngine() as receiver, TransferEngine() as sender:
        region = receiver.register(torch.zeros(nbytes, dtype=torch.uint8), target=True)
        src = sender.register(torch.ones(nbytes, dtype=torch.uint8))
        peer = sender.connect(receiver.address)
        connected = sender.stats()["peers"][peer.address]
        sender.write(peer, src, 0, region.descriptor(), 0, nbytes).wait(timeout=60)
        written = sender.stats()["peers"][peer.address]
        time.sleep(0.3)  # idle connections, each looked at again by the next stats()
        idle = sender.stats()["peers"][peer.address]
    # Connected but nothing sent: nothing measured.
    assert (connected["path_limited_bytes"], connected["path_limited_seconds"]) == (0, 0), connected
    # 64 MiB keep every connection's window full for a while: the path set the pace then,
    # for no longer than the write took, at about the write's average (on loopback its
    # start-up and last round trip take microseconds; what is left out of the count at
    # its edges moves the two apart by a few percent either way).
    assert 0 < written["path_limited_seconds"] <= written["seconds_busy"], written
    # The bytes it counts were sent: summed rate samples once read 10-20x more on loopback.
    assert 0 < written["path_limited_bytes"] <= written["bytes_sent"], written
    limited_rate = written["path_limited_bytes"] / written["path_limited_seconds"]
    assert limited_rate >= 0.8 * written["bytes_sent"] / written["seconds_busy"], written
    # Idle connections deliver nothing: the counters stand still.
    assert (idle["path_limited_bytes"], idle["path_limited_seconds"]) == (
        written["path_limited_bytes"], written["path_limited_seconds"]), (written, idle)
