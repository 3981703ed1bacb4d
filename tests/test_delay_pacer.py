"""The TCP backend's delay-based pacer (queue_delay_target_s): its control loop tested in
C++ against a fluid model of a bottleneck link (tests/cpp/delay_pacer_test.cpp: the queue
settles at the target with the link busy, on long and short round trips, through RTT
bursts, after the link gets slower or faster; a small message sent beside the paced bulk
waits little more than on the idle path, where unpaced bulk triples its delay; delay the
link does not cause slows it only to a floor), and the option end to end on loopback.
Through a real bottleneck: tests/test_transfer_wan.py (root)."""

from __future__ import annotations

import pytest
import torch

import cpp_unit
from pddcore.transfer import TransferEngine

PACER_CASES = ["long_rtt", "short_rtt", "bursty_short_rtt", "foreign_delay", "capacity_drop", "capacity_rise",
               "message_latency_under_bulk", "unpaced_until_a_queue", "token_bucket", "bad_arguments"]


test_delay_pacer = cpp_unit.case_test("delay_pacer_test", ["tests/cpp/delay_pacer_test.cpp",
                                                         "csrc/transport/tcp/delay_pacer.cpp"], PACER_CASES)


def _write(sender_options: dict, *, until=lambda stats: False, rounds: int = 3) -> dict:
    """Writes 32 MiB over loopback ``rounds`` times, or fewer once ``until(stats)`` holds;
    returns the sender's stats of that peer."""
    nbytes = 32 << 20
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    with TransferEngine(**sender_options) as sender, TransferEngine() as receiver:
        region = receiver.register(dst, target=True)
        peer = sender.connect(receiver.address)
        source = sender.register(src)
        for done in range(1, rounds + 1):
            sender.write(peer, source, 0, region.descriptor(), 0, nbytes).wait()
            stats = sender.stats()["peers"][receiver.address]
            if until(stats):
                break
    assert torch.equal(src, dst)
    assert stats["bytes_sent"] == done * nbytes
    return stats


def test_a_target_below_the_loopback_queue_makes_the_engine_pace():
    # Bulk over loopback queues some 100 us in the socket buffers, ten times this target:
    # the pacer must start pacing, having learned the path's rate from that queue. A loaded
    # machine may drain the first writes too fast to give it a sample, so up to 30 writes.
    stats = _write({"queue_delay_target_s": 10e-6}, rounds=30,
                   until=lambda s: s.get("paced_bps", 0) > 0 and s.get("link_rate_bps", 0) > 0)
    assert stats["queue_delay_s"] > 0, stats
    assert stats["link_rate_bps"] > 0, f"the pacer never saw a queue above its target: {stats}"
    assert stats["paced_bps"] > 0, f"the pacer saw a queue but did not pace: {stats}"


def test_unpaced_engine_reports_no_pacer():
    stats = _write({})
    assert not {"paced_bps", "link_rate_bps", "queue_delay_s"} & stats.keys(), stats


@pytest.mark.parametrize("bad", [0, -0.5])
def test_queue_delay_target_must_be_positive(bad):
    with pytest.raises(ValueError, match="queue_delay_target_s must be positive"):
        TransferEngine(queue_delay_target_s=bad)
