"""One-sided, verified memory transfers between pddcore engines.

A :class:`TransferEngine` listens on a TCP port, registers memory regions, connects to
peer engines and writes bytes from its own regions into a peer's regions. The C++ core
splits each write into chunks (``chunk_bytes``) spread over ``streams`` parallel
connections with many chunks in flight; the receiver reads each chunk straight into the
destination region, checks its CRC32C and acknowledges it. A :class:`Transfer` is *done*
only when every chunk was verified and applied at the destination; a write's ``notify``
payload reaches the peer's :meth:`TransferEngine.poll_messages` only after that.

Failure model: a broken stream hands its unacknowledged chunks to the other streams and
reconnects (up to ``max_retries`` times); a CRC mismatch resends the chunk; an unknown
region or out-of-bounds write fails the transfer with the peer's reason; a peer that
acknowledges nothing for ``timeout_s`` fails its transfers. Nothing waits forever, and
every wait releases the GIL. After a failed or cancelled transfer the destination range
holds unspecified bytes (chunks are written in place), but it is never reported applied.

Example::

    import torch
    from pddcore import TransferEngine
    from pddcore.transfer import new_auth_token

    token = new_auth_token()           # the same on every engine of a deployment (`pddcore token`)
    with TransferEngine(auth_token=token) as md, TransferEngine(auth_token=token) as p:
        dst = md.register(torch.zeros(1 << 20, dtype=torch.uint8), target=True)
        src = p.register(torch.randint(0, 255, (1 << 20,), dtype=torch.uint8))
        peer = p.connect(md.address)
        t = p.write(peer, src, 0, dst.descriptor(), 0, 1 << 20, notify=b"req-42")
        t.wait()                       # raises TransferError on failure
        md.poll_messages()             # [Message(p.address, p.engine_id, b"req-42", notification=True)]

RDMA: ``TransferEngine(backend="rdma", device=None, ib_port=1, gid_index=None)`` moves the
same writes over reliable-connected ibverbs QPs (libibverbs is opened at run time; no
RDMA device -> TransferError listing the usable backends). Per peer, QP attributes (LID/GID,
QPN, PSN, MTU) and destination rkeys are exchanged on a connection behind the same
handshake; a write becomes a chain of RDMA WRITEs, selectively signaled, the last one
RDMA_WRITE_WITH_IMM; done means the responder acknowledged (RC) every WR. An rdma engine
also speaks tcp: ``connect(address, backend="tcp")`` picks the data path per peer. On
machines without a NIC, ``device="emulator"`` (or ``PDDCORE_VERBS=emulator``) selects the
in-process verbs emulator, a test device with real verbs semantics over loopback sockets.

GPU memory over RDMA: with the peer-memory module loaded (``nvidia-peermem``, or the
kernel's dma-buf path on newer drivers) ``ibv_reg_mr`` accepts a CUDA device pointer and
the NIC reads and writes GPU memory directly (GPUDirect RDMA). Register it by address,
``engine.register_pointer(t.data_ptr(), t.numel() * t.element_size())``, keeping ``t``
alive until unregister; without the module the registration fails with ``Bad address``.
The verbs emulator touches memory with the CPU, so it only takes host memory.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterable

import numpy as np
import torch

from . import _C
from .auth_token import MIN_AUTH_TOKEN_BYTES, new_auth_token
from .transfer_types import Message, Peer, Region, RegionDescriptor, Transfer, TransferError, WriteSpec

__all__ = ["TransferEngine", "Region", "Peer", "Transfer", "TransferError", "RegionDescriptor", "Message",
           "WriteSpec", "available_congestion_controls", "new_auth_token", "MIN_AUTH_TOKEN_BYTES",
           "engine_id_for_name"]


def engine_id_for_name(name: str) -> int:
    """The engine id of an engine whose TLS certificate's subject common name is ``name``:
    the first 8 bytes, little-endian, of SHA-256(``"pddcore engine id v1\\n" + name``). With
    certificates this is the ``engine_id`` (and ``sender_engine_id``) peers see."""
    return _C.engine_id_for_name(name)


def _fold_congestion_control(peer: dict) -> dict:
    """The core counts live data connections per algorithm as ``"congestion_control:<name>"``
    (its stats are name -> float); stats() shows them as one ``{name: count}`` entry."""
    out = {k: v for k, v in peer.items() if not k.startswith("congestion_control:")}
    out["congestion_control"] = {k.split(":", 1)[1]: v for k, v in peer.items()
                                 if k.startswith("congestion_control:")}
    return out


def available_congestion_controls() -> list[str]:
    """The TCP congestion controls this kernel offers (``TransferEngine(congestion_control=...)``)."""
    return _C.available_congestion_controls()


def _as_ints(**values: Any) -> dict[str, int | None]:
    """The engine's integer arguments as ints for the core, which checks their ranges; None
    (absent) passes. A float, bool or str is refused here, where its Python type still shows
    (in the core it would be a failed conversion)."""
    for name, v in values.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))):
            raise ValueError(f"{name} must be an int, got {v!r}")
    return {name: None if v is None else int(v) for name, v in values.items()}


def _buffer_address(obj: Any) -> tuple[int, int, Any]:
    """(address, nbytes, keep-alive) of a contiguous CPU tensor or writable buffer."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise ValueError(f"only CPU tensors can be registered with the tcp backend, got {obj.device}")
        if not obj.is_contiguous():
            raise ValueError(f"tensor must be contiguous, got strides {obj.stride()} for shape {tuple(obj.shape)}")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"cannot register {type(obj).__name__}: need a CPU torch.Tensor or a buffer") from None
    if view.readonly:
        raise ValueError(f"cannot register a read-only buffer ({type(obj).__name__})")
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    arr = np.frombuffer(view.cast("B"), dtype=np.uint8)  # holds the buffer export: no resize while registered
    return arr.ctypes.data, arr.nbytes, arr


class TransferEngine:
    """Registered memory, peers, verified one-sided writes and priority messages.

    Args:
        backend: data path; ``"tcp"`` (chunked, multi-stream) or ``"rdma"`` (ibverbs RC; see the module docstring).
        listen: ``"host:port"`` to listen on (port 0: any free port); see :attr:`address`.
        streams: parallel data connections per peer, or ``"auto"`` (the default): each peer
            starts with 4 and gets more, up to 16 and never fewer again, while its path asks
            for them: when rate x RTT (measured while the path set the pace) needs twice the
            payload 4 connections' send buffers (``net.ipv4.tcp_wmem``'s ceiling) hold, or,
            on cubic connections, the loss rate keeps each one's window small. ``stats()``
            shows each peer's count as ``streams``. On rdma ``"auto"`` is 4 QPs.
        chunk_bytes: largest chunk on the wire (each has its own header, CRC and ack).
        auth_token: when set, every connection must prove knowledge of this token with an
            HMAC-SHA256 challenge-response, both ways: this engine also refuses a peer that
            does not prove it. The token never crosses the wire. Required when ``listen`` is
            not a loopback address, unless ``insecure=True``. It must hold 128 random bits:
            shorter than :data:`MIN_AUTH_TOKEN_BYTES` (32) bytes, or fewer than 8 distinct
            bytes, is refused (ValueError); :func:`new_auth_token` or ``pddcore token`` makes
            one. Every holder of the token can act as every engine of the deployment.
        insecure: allow listening beyond loopback without ``auth_token`` (a trusted network only).
        tls: TLS 1.3 on every connection (control, data, RDMA setup), AES-128-GCM with a key
            pre-shared through ``auth_token`` and fresh (EC)DHE keys per connection: what an
            on-path attacker sees is ciphertext, and a rewritten record is detected (the
            connection drops, the chunk is resent; ``stats()["tls_errors"]`` counts it). Both
            ends must set it. Meant for the WAN leg; inside a datacenter the token suffices.
        tls_cert, tls_key, tls_ca: TLS 1.3 with certificates instead (all three PEM files:
            this engine's certificate, its private key, the deployment's CA; ``tls`` is then
            implied). Both ends present a certificate and verify the other's chain against
            the CA (mutual TLS): a peer without one, with one from another CA, or expired is
            refused at the TLS handshake. The certificate's subject common name is the
            engine's name and fixes its :attr:`engine_id` (:func:`engine_id_for_name`); a
            peer stating another id is refused, so ``sender_engine_id``, fences and pulls
            name the engine that holds the certificate. ``auth_token`` is then optional
            (checked as well when given). ``pddcore certs`` makes a test CA and certificates.
        timeout_s: connect deadline, one deadline for a whole handshake, and how long a peer
            may acknowledge nothing before its transfers fail.
        max_connections, max_connections_per_host: authenticated connections served at
            once, in all and from one IP address; beyond them a connection is closed once it
            authenticates. ``max_connections`` is clamped to 40 % of this process's file
            descriptor limit (all served connections together stay within half of it).
            Connections still in their handshake have their own budget, a quarter of each
            (at least 1): beyond the per-address one a new connection is closed at accept,
            and when the one in all is full, a newcomer from an address holding fewer
            handshakes displaces the oldest handshake of the address holding the most, so a
            flood from a few hosts cannot keep an authenticated peer out. Every connection so
            closed counts in ``stats()["connections_refused"]``; ``stats()["accept_stalls"]``
            counts accepts that failed for want of file descriptors (the listener then backs
            off, up to half a second, instead of spinning).
        max_inbox_bytes: received messages and notifications waiting for
            :meth:`poll_messages`, each counted as its payload and sender address plus 256
            bytes (so empty messages fill it too); a peer sending more waits until there is room.
        congestion_control: the kernel's TCP congestion control for the data connections this
            engine dials (``"cubic"``, ``"bbr"``, ...; see :func:`available_congestion_controls`);
            None: the system default. It governs how a lossy, long path is filled. The default,
            ``"auto"``, chooses per data connection from what its path shows: once its
            handshake is done, a minimum RTT below 5 ms (loopback, one datacenter) gets
            cubic, a longer one bbr (it keeps a long path full through random loss, where
            loss-based cubic backs off at every drop); a cubic connection on a path of
            1 ms or more that then retransmits 1 % of its segments (from 1000 on, past slow
            start, with no queue standing) switches the peer's connections to bbr for good. A kernel without cubic gets the system default, one without
            bbr keeps cubic. ``stats()["peers"]`` shows the choice; ``pddcore bench --cases loss``,
            ``wan10g`` and ``transfer`` measure it against cubic and bbr chosen by hand.
        idle_timeout_s: a data connection that carries nothing this long is closed here
            (``stats()["connections_idled"]``); a sender dials again when it has chunks.
        rate_limit_bps: pace all outgoing data below this many bits per second (None: no limit).
        queue_delay_target_s: tcp: pace each peer's bulk data to its path, so that the queue
            it builds at the bottleneck stays below about this many seconds (None: off).
            The engine learns the path's rate from what the kernel reports delivered and
            backs off when the data connections' RTT rises above the path's minimum
            (delay-based, in the spirit of LEDBAT). Priority messages then see close to idle
            latency while bulk transfers run, without configuring the line rate; the cost is
            a few percent of throughput. A few ms suits a WAN; stats() shows the pacer. A
            chunk leaves as one burst: keep chunk_bytes near a millisecond of the link.
        max_retries: resends of one chunk, and reconnects of one stream, before failing.
        device: rdma only: device name (e.g. ``"mlx5_0"``; None: the first one, or the verbs
            emulator when ``PDDCORE_VERBS=emulator``; ``"emulator"``: the verbs emulator).
            ``streams`` is the number of RC QPs per peer (``"auto"``: 4).
        ib_port: rdma only: the device port.
        gid_index: rdma only: GID table index for routed (GRH) addressing; None: none on
            InfiniBand, GID 0 on RoCE.

    Thread-safe: any number of Python threads may call it at once.
    """

    def __init__(self, backend: str = "tcp", listen: str = "127.0.0.1:0", *, streams: int | str = "auto",
                 chunk_bytes: int = 1 << 20, auth_token: bytes | str | None = None, timeout_s: float = 30.0,
                 rate_limit_bps: float | None = None, max_retries: int = 5, device: str | None = None,
                 ib_port: int = 1, gid_index: int | None = None, queue_delay_target_s: float | None = None,
                 insecure: bool = False, max_connections: int = 1024, max_connections_per_host: int = 256,
                 max_inbox_bytes: int = 64 << 20, tls: bool = False, idle_timeout_s: float = 300.0,
                 congestion_control: str | None = "auto", tls_cert: str | os.PathLike | None = None,
                 tls_key: str | os.PathLike | None = None, tls_ca: str | os.PathLike | None = None):
        # Every argument is checked once, in the core (csrc/transport/engine_arguments.cpp);
        # here Python's forms become the core's: str tokens, paths, "auto" streams.
        if isinstance(auth_token, str):
            auth_token = auth_token.encode()
        self._core = _C.TransferEngineCore(
            backend=backend, listen=listen, auth_token=auth_token, insecure=bool(insecure), tls=bool(tls),
            **{name: "" if f is None else os.fspath(f) for name, f in (("tls_ca", tls_ca), ("tls_cert", tls_cert),
                                                                      ("tls_key", tls_key))},
            congestion_control=congestion_control, timeout_s=timeout_s, rate_limit_bps=rate_limit_bps,
            queue_delay_target_s=queue_delay_target_s, idle_timeout_s=idle_timeout_s, rdma_device=device,
            **_as_ints(streams=None if streams == "auto" else streams, chunk_bytes=chunk_bytes, max_retries=max_retries,
                       max_connections=max_connections, max_connections_per_host=max_connections_per_host,
                       max_inbox_bytes=max_inbox_bytes, ib_port=ib_port, gid_index=gid_index))
        self._lock = threading.Lock()
        self._regions: dict[int, Region] = {}
        self.timeout_s = float(timeout_s)
        #: The TCP congestion control of the data connections this engine dials (None: the
        #: system default; ``"auto"``: chosen per connection, see ``stats()``).
        self.congestion_control = self._core.congestion_control or None

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``"host:port"`` this engine listens on."""
        return self._core.address

    @property
    def engine_id(self) -> int:
        """This engine's id as peers see it (``sender_engine_id``): random per engine, or with
        certificates, :func:`engine_id_for_name` of its certificate's common name."""
        return self._core.engine_id

    @property
    def backend(self) -> str:
        return self._core.backend

    def close(self) -> None:
        """Stops all threads and closes all connections; pending transfers fail. Idempotent."""
        self._core.close()
        with self._lock:
            self._regions.clear()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- memory --------------------------------------------------------------------------

    def register(self, memory: Any, *, target: bool = False) -> Region:
        """Registers a contiguous CPU tensor or writable buffer; the engine keeps it alive
        until :meth:`unregister`. ``target=True``: peers may write into it (a receive
        buffer); otherwise it is a source, which no peer can write or see listed."""
        base, nbytes, keep = _buffer_address(memory)
        if nbytes == 0:
            raise ValueError("cannot register an empty buffer")
        return self._add_region(base, nbytes, target, False, keep)

    def register_pointer(self, base: int, nbytes: int, *, target: bool = False, listed_address: bool = False,
                         keep_alive: Any = None) -> Region:
        """Registers raw memory by address (``target`` as in :meth:`register`). The caller
        keeps that memory alive until :meth:`unregister`, or passes an owner of it as
        ``keep_alive`` for the region to hold. ``listed_address=True`` (targets only): peers'
        :meth:`remote_regions` show its virtual address, for pointer-addressed APIs."""
        if base <= 0 or nbytes <= 0:
            raise ValueError(f"bad memory range: base={base:#x} nbytes={nbytes}")
        return self._add_region(base, nbytes, target, listed_address, keep_alive)

    def _add_region(self, base: int, nbytes: int, target: bool, listed_address: bool, keep: Any) -> Region:
        region = Region(self, self._core.register_memory(base, nbytes, bool(target), bool(listed_address)), base,
                        nbytes, bool(target), keep)
        with self._lock:
            self._regions[region.id] = region
        return region

    def unregister(self, region: Region) -> None:
        """Unregisters; refused while the region is the source of an active transfer.
        Otherwise the region is withdrawn at once (no new chunk reaches it), and this waits
        up to ``timeout_s`` for chunks still reading or writing it. If one still is, it raises
        TransferError and the region stays registered (in :meth:`regions`, its memory kept
        alive): call it again, and it returns once the last chunk let go."""
        self._check_own(region)
        self._core.unregister_memory(region.id)
        with self._lock:
            self._regions.pop(region.id, None)

    def regions(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())

    def _check_own(self, region: Region) -> None:
        if not isinstance(region, Region):
            raise TypeError(f"expected a Region, got {type(region).__name__}")
        if region.engine is not self:
            raise ValueError(f"{region} belongs to another engine")

    # -- peers and writes ---------------------------------------------------------------

    def connect(self, address: str, backend: str | None = None) -> Peer:
        """Connects (and authenticates) to the engine listening at ``address``; ``backend``
        picks this peer's data path (None: the engine's own; an rdma engine also has "tcp")."""
        return Peer(self, self._core, self._core.connect(address, backend or ""))

    def write(self, peer: Peer, src_region: Region, src_offset: int, dst_descriptor: bytes | RegionDescriptor,
              dst_offset: int, nbytes: int, *, notify: bytes | None = None) -> Transfer:
        """Writes ``nbytes`` from ``src_region[src_offset:]`` to the peer's region at ``dst_offset``."""
        return self.write_batch(peer, [(src_region, src_offset, dst_descriptor, dst_offset, nbytes)], notify=notify)

    def write_batch(self, peer: Peer, writes: Iterable[WriteSpec], *, notify: bytes | None = None) -> Transfer:
        """One transfer of many writes ``(src_region, src_offset, dst_descriptor, dst_offset, nbytes)``.

        Every range is checked before anything is sent: a source outside its region, a
        descriptor of another engine or a destination outside the described region raises
        ValueError. (The receiver checks again and rejects what slips through.)
        """
        if not isinstance(peer, Peer) or peer.engine is not self:
            raise ValueError("peer must be a Peer returned by this engine's connect()")
        ops = []
        for i, spec in enumerate(writes):
            if len(spec) != 5:
                raise ValueError(f"write {i}: expected (src_region, src_offset, dst_descriptor, dst_offset, nbytes)")
            src, src_off, desc, dst_off, n = spec
            self._check_own(src)
            desc = RegionDescriptor.from_bytes(desc)
            for name, v in (("src_offset", src_off), ("dst_offset", dst_off), ("nbytes", n)):
                if not isinstance(v, (int, np.integer)) or v < 0:
                    raise ValueError(f"write {i}: {name} must be a non-negative int, got {v!r}")
            if n == 0:
                raise ValueError(f"write {i}: nbytes is 0")
            if src_off + n > src.nbytes:
                raise ValueError(f"write {i}: source range [{src_off}, {src_off + n}) is outside {src}")
            if desc.engine_id != peer.engine_id:
                raise ValueError(f"write {i}: the destination region belongs to engine {desc.address}, "
                                 f"not to peer {peer.address}")
            if dst_off + n > desc.size:
                raise ValueError(f"write {i}: destination range [{dst_off}, {dst_off + n}) is outside "
                                 f"region {desc.region_id} of {desc.size} bytes")
            ops.append((src.id, int(src_off), desc.region_id, int(dst_off), int(n)))
        if not ops:
            raise ValueError("write_batch needs at least one write")
        if notify is not None and not isinstance(notify, (bytes, bytearray)):
            raise TypeError(f"notify must be bytes, got {type(notify).__name__}")
        return Transfer(self._core, self._core.write_batch(peer._handle, ops, None if notify is None else bytes(notify)))

    # -- messages --------------------------------------------------------------------------

    def send(self, peer: Peer, message: bytes) -> None:
        """Sends a small message on the peer's priority lane (its own connection, never
        queued behind bulk data). Returns once written to the connection."""
        if not isinstance(message, (bytes, bytearray)):
            raise TypeError(f"message must be bytes, got {type(message).__name__}")
        self._core.send(peer._handle, bytes(message))

    def poll_messages(self, timeout: float = 0.0) -> list[Message]:
        """Messages and write notifications received since the last call, in arrival order,
        as :class:`Message` ``(sender, sender_engine_id, payload, notification)``. When there
        are none, waits up to ``timeout`` seconds (GIL released) for the first."""
        return [Message(*m) for m in self._core.poll_messages(float(timeout))]

    def remote_regions(self, peer: Peer) -> list[tuple[int, int, int]]:
        """The peer's write targets as ``(region_id, base_address, nbytes)``; ``base_address``
        is 0 unless the peer registered the region with ``listed_address=True``, and sources
        are never listed."""
        return self._core.remote_regions(peer._handle)

    # -- stats ----------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters since the engine started (all values are floats).

        Top level:
            ``bytes_sent`` / ``chunks_sent``: payload acknowledged by peers (verified and applied);
            ``bytes_received`` / ``chunks_received``: payload this engine verified and applied;
            ``chunks_rejected``: incoming chunks refused (bad CRC, bounds, region, header);
            ``retries``: chunk resends (lost connection or CRC mismatch); ``crc_errors``:
            resends caused by a CRC mismatch at the peer; ``transfers_active`` /
            ``transfers_done`` / ``transfers_failed`` / ``transfers_cancelled``;
            ``messages_sent`` / ``messages_received`` (priority lane, notifications included).

        ``peers``: ``{peer address: {...}}`` for every peer this engine connected to:
            ``bytes_sent``: bytes the peer verified and applied;
            ``chunks_sent``, ``retries``, ``transfers_done``, ``transfers_failed``;
            ``seconds_busy``: wall time during which at least one transfer to the peer was
            active; ``throughput_bps``: ``bytes_sent * 8 / seconds_busy`` in **bits** per second
            (achieved goodput while busy; 0 before any);
            ``rtt_s``: smoothed round-trip time of the priority lane, from pings once a second;
            ``connected``: 1.0 while the control connection is up.
            tcp peers: ``streams``, the data connections this engine runs to the peer
            (chosen with ``streams="auto"``); ``live_streams``, those open now; ``cwnd_bytes``, their
            congestion windows summed (what the path lets the engine keep in flight);
            ``tcp_retransmits``, segments they sent again (TCP_INFO);
            ``congestion_control``, ``{algorithm: live data connections running it}``
            read back from the sockets (the one value that is not a float); with
            ``congestion_control="auto"`` also ``handshake_rtt_s``, the lowest minimum RTT
            the live connections measured by the end of their handshake (what each chose
            its algorithm from), and ``congestion_switches``, connections switched to bbr
            on loss;
            ``path_limited_bytes`` / ``path_limited_seconds``, the
            bytes the kernel acknowledged while the path, not this sender, set the pace, and
            that time: their ratio is the path's rate (bytes/s) and what the router's
            bandwidth estimate reads, since ``throughput_bps`` also counts the waits of a
            sender that streams layers as prefill writes them.
            With ``queue_delay_target_s`` (tcp peers): ``paced_bps``, the pacer's current rate
            (0 while unpaced); ``link_rate_bps``, the path rate it learned;
            ``queue_delay_s``, the data connections' smoothed RTT above the path's minimum.
        """
        out: dict = dict(self._core.totals())
        out["peers"] = {addr: _fold_congestion_control(s) for addr, s in self._core.peer_stats().items()}
        return out

    # -- test hooks ------------------------------------------------------------------------

    def _debug_kill_stream(self, peer: Peer, stream: int) -> None:
        """Test hook: breaks the connection of one data stream to ``peer``."""
        self._core.debug_kill_stream(peer._handle, stream)

    def _debug_corrupt_chunks(self, n: int) -> None:
        """Test hook: flips a payload byte (after its CRC was taken) in the next ``n`` chunks sent."""
        self._core.debug_corrupt_chunks(n)

    def __repr__(self) -> str:
        return f"TransferEngine({self.backend!r}, {self.address})"
