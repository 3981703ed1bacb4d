"""TransferEngine's arguments are checked in one place, the C++ core: the core refuses each
bad argument by itself with the error TransferEngine shows, and TransferEngine lets
through every value the core accepts (it only turns Python's forms into the core's)."""

from __future__ import annotations

import pytest

from pddcore import _C
from pddcore.transfer import MIN_AUTH_TOKEN_BYTES, TransferEngine, available_congestion_controls

TOKEN = b"engine-arguments-token-3b7e1d9c5a2f8046"

# What TransferEngine passes the core for its defaults.
CORE_DEFAULTS = dict(backend="tcp", listen="127.0.0.1:0", streams=None, chunk_bytes=1 << 20, auth_token=None,
                     insecure=False, tls=False, tls_ca="", tls_cert="", tls_key="", congestion_control="auto",
                     timeout_s=30.0, rate_limit_bps=None, queue_delay_target_s=None, max_retries=5,
                     max_connections=1024, max_connections_per_host=256, max_inbox_bytes=64 << 20,
                     idle_timeout_s=300.0, rdma_device=None, ib_port=1, gid_index=None)

# (the argument as TransferEngine takes it, the same for the core, what the error says)
BAD = [
    (dict(streams=0), dict(streams=0), "streams must be in \\[1, 64\\], got 0"),
    (dict(streams=65), dict(streams=65), "streams must be in \\[1, 64\\], got 65"),
    (dict(chunk_bytes=0), dict(chunk_bytes=0), "chunk_bytes must be in \\[1, "),
    (dict(listen="0.0.0.0:0"), dict(listen="0.0.0.0:0"), "on 0.0.0.0 .* needs an auth_token or certificates"),
    (dict(listen="127.0.0.1"), dict(listen="127.0.0.1"), "listen: address must be 'host:port'"),
    (dict(auth_token=b"ab" * 32), dict(auth_token=b"ab" * 32), "at least 8 distinct values, got 64 bytes of 2"),
    (dict(auth_token="x" * 31), dict(auth_token=b"x" * 31), "at least 32 bytes .* got 31 bytes"),
    (dict(tls=True), dict(tls=True), "tls=True needs an auth_token"),
    (dict(tls_cert="c.pem", tls_key="k.pem"), dict(tls_cert="c.pem", tls_key="k.pem"), "all of tls_cert, tls_key"),
    (dict(congestion_control="no-such-cc"), dict(congestion_control="no-such-cc"), "not offered by this kernel"),
    (dict(timeout_s=0), dict(timeout_s=0.0), "timeout_s must be positive, got 0"),
    (dict(idle_timeout_s=-1), dict(idle_timeout_s=-1.0), "idle_timeout_s must be positive, got -1"),
    (dict(rate_limit_bps=0), dict(rate_limit_bps=0.0), "rate_limit_bps must be positive, got 0"),
    (dict(queue_delay_target_s=float("nan")), dict(queue_delay_target_s=float("nan")),
     "queue_delay_target_s must be positive, got nan"),
    (dict(max_retries=-1), dict(max_retries=-1), "max_retries must be in \\[0, "),
    (dict(max_connections=0), dict(max_connections=0), "max_connections must be in \\[1, "),
    (dict(max_connections_per_host=-2), dict(max_connections_per_host=-2), "max_connections_per_host must be in"),
    (dict(max_inbox_bytes=0), dict(max_inbox_bytes=0), "max_inbox_bytes must be in \\[1, "),
    (dict(device="emulator"), dict(rdma_device="emulator"), "apply to the rdma backend, not 'tcp'"),
    (dict(backend="rdma", device="emulator", ib_port=0), dict(backend="rdma", rdma_device="emulator", ib_port=0),
     "bad RDMA port 0"),
]


@pytest.mark.parametrize("engine_kwargs, core_kwargs, error", BAD, ids=[e for _, _, e in BAD])
def test_the_core_refuses_each_bad_argument_as_the_engine_does(engine_kwargs, core_kwargs, error):
    with pytest.raises(ValueError, match=error):
        _C.TransferEngineCore(**{**CORE_DEFAULTS, **core_kwargs})
    with pytest.raises(ValueError, match=error):
        TransferEngine(**engine_kwargs)


@pytest.mark.parametrize("kwargs", [dict(streams=1), dict(streams=64), dict(max_retries=0), dict(chunk_bytes=1),
                                    dict(auth_token=TOKEN, listen="0.0.0.0:0"), dict(insecure=True, listen="0.0.0.0:0"),
                                    dict(listen="localhost:0"), dict(listen="127.0.0.2:0"),
                                    dict(rate_limit_bps=1e9, queue_delay_target_s=0.005)])
def test_the_engine_passes_every_value_the_core_accepts(kwargs):
    with TransferEngine(**kwargs) as engine:
        assert engine.address.rsplit(":", 1)[1] != "0"


def test_a_token_of_the_minimum_length_and_variety_is_accepted():
    token = bytes(range(8)) * (MIN_AUTH_TOKEN_BYTES // 8)
    with TransferEngine(auth_token=token):
        pass
    with pytest.raises(ValueError, match="got 31 bytes of 8"):
        TransferEngine(auth_token=token[:-1])


def test_congestion_controls_are_the_kernels():
    try:
        with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
            offered = f.read().split()
    except OSError:
        offered = []
    assert available_congestion_controls() == offered
    with TransferEngine(congestion_control=None) as engine:
        assert engine.congestion_control is None
    with TransferEngine() as engine:  # "auto" needs cubic; without it the system default
        assert engine.congestion_control == ("auto" if "cubic" in offered else None)
