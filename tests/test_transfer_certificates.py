"""Engine identities from X.509 certificates (TransferEngine's tls_cert/tls_key/tls_ca): mutual
TLS against a deployment's CA, and the engine id bound to the certificate's common name, so
a peer can speak, notify and fence only as the engine its certificate names. Real engines and
an independent client (Python's ssl and hmac) on loopback sockets."""

from __future__ import annotations

import datetime
import hashlib
import socket
import ssl
import struct
import threading

import pytest

from pddcore.certificates import make_ca, make_engine_certificate
from pddcore.cli import main as pddcore_main
from pddcore.transfer import TransferEngine, TransferError, engine_id_for_name

from test_transfer_security import FENCE_ACK, FENCED, fence_reply, wait_until
from test_transfer_tcp import _ACK, _CHALLENGE, _HELLO, _RESULT, HELLO_MAGIC, TOKEN, WIRE_VERSION, _recv_exact, \
    chunk_frame, python_handshake


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A deployment CA with engines "md", "victim" and "attacker"; another CA with "md"."""
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root / "ca")
    other = make_ca(root / "other", name="another deployment's CA")
    return {
        "md": make_engine_certificate(root / "ca", "md", ca),
        "victim": make_engine_certificate(root / "ca", "victim", ca),
        "attacker": make_engine_certificate(root / "ca", "attacker", ca),
        "expired": make_engine_certificate(root / "ca", "expired", ca, valid_days=1, valid_from=(
            datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(days=3))),
        "foreign md": make_engine_certificate(root / "other", "md", other),
    }


def tls_as(certificate):
    """Wraps a socket in TLS 1.3 presenting ``certificate`` and verifying the server's chain
    against its CA (no host name: an engine's certificate names the engine, not a host)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.check_hostname = False
    context.load_verify_locations(certificate.ca)
    context.load_cert_chain(certificate.cert, certificate.key)
    return context.wrap_socket


def test_engine_id_is_the_one_its_certificate_names(pki, tmp_path):
    """The id is SHA-256("pddcore engine id v1\\n" + common name)[:8] little-endian (checked with
    hashlib), peers see it on connect and on every message; `pddcore certs` makes working files."""
    assert pddcore_main(["certs", str(tmp_path), "--engines", "p-0", "md-0"]) == 0
    files = {name: dict(tls_cert=tmp_path / f"{name}.pem", tls_key=tmp_path / f"{name}.key", tls_ca=tmp_path / "ca.pem")
             for name in ("p-0", "md-0")}
    with TransferEngine(**files["md-0"]) as md, TransferEngine(**files["p-0"]) as p:
        expected = int.from_bytes(hashlib.sha256(b"pddcore engine id v1\nmd-0").digest()[:8], "little")
        assert md.engine_id == engine_id_for_name("md-0") == expected
        peer = p.connect(md.address)
        assert peer.engine_id == md.engine_id
        p.send(peer, b"hello")
        got = []
        wait_until(lambda: got.extend(md.poll_messages(timeout=0.2)) or got)
        assert [(m.payload, m.sender_engine_id) for m in got] == [(b"hello", engine_id_for_name("p-0"))]


def test_a_token_holder_without_a_certificate_cannot_connect(pki):
    """An engine with certificates and a token refuses token holders that present no
    certificate: with the token's pre-shared-key TLS, and with no TLS at all."""
    with TransferEngine(auth_token=TOKEN, timeout_s=5, **pki["md"].engine_kwargs()) as md:
        for client_tls in (True, False):
            with TransferEngine(auth_token=TOKEN, tls=client_tls, timeout_s=5) as holder:
                with pytest.raises(TransferError):
                    holder.connect(md.address)
        wait_until(lambda: md.stats()["tls_errors"] >= 2)
        with TransferEngine(auth_token=TOKEN, timeout_s=5, **pki["victim"].engine_kwargs()) as member:
            assert member.connect(md.address).engine_id == md.engine_id


def test_a_peer_cannot_claim_another_engines_id(pki):
    """With the attacker's certificate, a hello claiming the victim's id is refused on control
    and data connections; claiming its own id works."""
    with TransferEngine(timeout_s=5, **pki["md"].engine_kwargs()) as md:
        attacker_tls = tls_as(pki["attacker"])
        for kind in (0, 1):
            with pytest.raises(PermissionError, match="engine id is not the one the client's certificate names"):
                python_handshake(md.address, None, kind=kind, engine_id=engine_id_for_name("victim"),
                                 secure=attacker_tls)
        python_handshake(md.address, None, kind=0, engine_id=engine_id_for_name("attacker"), secure=attacker_tls).close()


def test_a_peer_cannot_fence_or_notify_as_another_engine(pki):
    """The attacker's fence for the victim's transfer tag holds only the attacker's own
    chunks: the victim's chunk with that tag lands. The victim's own fence does drop it (the
    fence works). A message the attacker sends names the attacker."""
    with TransferEngine(timeout_s=5, **pki["md"].engine_kwargs()) as md:
        buf = bytearray(4096)
        region = md.register(buf, target=True)
        attacker_id, victim_id = engine_id_for_name("attacker"), engine_id_for_name("victim")
        tag = 0x5EED
        with python_handshake(md.address, None, kind=0, engine_id=attacker_id, secure=tls_as(pki["attacker"])) as evil, \
                python_handshake(md.address, None, kind=1, engine_id=victim_id, secure=tls_as(pki["victim"])) as data, \
                python_handshake(md.address, None, kind=0, engine_id=victim_id, secure=tls_as(pki["victim"])) as own:
            assert fence_reply(evil, tag) == FENCE_ACK
            data.sendall(chunk_frame(1, region.id, 0, b"v" * 64, tag=tag))
            assert _ACK.unpack(_recv_exact(data, _ACK.size))[1] == 0
            assert bytes(buf[:64]) == b"v" * 64
            assert fence_reply(own, tag) == FENCE_ACK
            data.sendall(chunk_frame(2, region.id, 64, b"w" * 64, tag=tag))
            assert _ACK.unpack(_recv_exact(data, _ACK.size))[1] == FENCED
            assert bytes(buf[64:128]) == b"\0" * 64
        with TransferEngine(timeout_s=5, **pki["attacker"].engine_kwargs()) as attacker:
            attacker.send(attacker.connect(md.address), b"KV of victim's request is ready")
            got = []
            wait_until(lambda: got.extend(md.poll_messages(timeout=0.2)) or got)
            assert [m.sender_engine_id for m in got] == [attacker_id]


def test_a_client_refuses_a_server_stating_an_id_its_certificate_does_not_name(pki):
    """A server holding the "md" certificate (Python's ssl, mutual TLS against the same CA)
    whose Result states the victim's engine id: the client refuses it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(pki["md"].ca)
    context.load_cert_chain(pki["md"].cert, pki["md"].key)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        conn, _ = listener.accept()
        with context.wrap_socket(conn, server_side=True) as tls:
            _recv_exact(tls, _HELLO.size)
            tls.sendall(_CHALLENGE.pack(HELLO_MAGIC, WIRE_VERSION, 0, b"\2" * 16))
            _recv_exact(tls, 32)
            tls.sendall(_RESULT.pack(0, engine_id_for_name("victim"), b"\0" * 32, b"\0" * 96))
            tls.recv(1)  # until the client hangs up

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    try:
        with TransferEngine(timeout_s=5, **pki["attacker"].engine_kwargs()) as client:
            with pytest.raises(TransferError, match="states an engine id its certificate does not name"):
                client.connect(f"127.0.0.1:{listener.getsockname()[1]}")
    finally:
        server.join(10)
        listener.close()


def test_certificates_from_another_ca_are_refused_both_ways(pki):
    """A client whose chain leads to another CA is refused by the server, and a server whose
    chain leads to another CA is refused by the client; an engine will not start with a
    certificate its own CA file does not verify."""
    with TransferEngine(timeout_s=5, **pki["md"].engine_kwargs()) as md, \
            TransferEngine(timeout_s=5, **pki["foreign md"].engine_kwargs()) as foreign:
        with pytest.raises(TransferError, match="TLS handshake failed"):
            foreign.connect(md.address)
        with TransferEngine(timeout_s=5, **pki["victim"].engine_kwargs()) as client:
            with pytest.raises(TransferError, match="peer certificate: (self-signed certificate in certificate chain|unable to get local issuer)"):
                client.connect(foreign.address)
    mixed = dict(pki["foreign md"].engine_kwargs(), tls_ca=str(pki["md"].ca))
    with pytest.raises(ValueError, match="does not verify against the CA"):
        TransferEngine(**mixed)


def test_an_expired_certificate_is_refused(pki):
    """A client presenting an expired certificate from the right CA gets no challenge, and the
    engine counts a TLS error; an engine will not start with one."""
    with TransferEngine(timeout_s=5, **pki["md"].engine_kwargs()) as md:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            python_handshake(md.address, None, kind=0, engine_id=engine_id_for_name("expired"),
                             secure=tls_as(pki["expired"]))
        wait_until(lambda: md.stats()["tls_errors"] >= 1)
    with pytest.raises(ValueError, match="certificate has expired"):
        TransferEngine(**pki["expired"].engine_kwargs())


def test_the_challenge_names_no_engine():
    """A client that cannot prove the token learns nothing that names the engine: not in the
    challenge, not in the refusal."""
    with TransferEngine(auth_token=TOKEN, timeout_s=5) as engine:
        host, port = engine.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(_HELLO.pack(HELLO_MAGIC, WIRE_VERSION, 0, 0, 1, b"\1" * 16, b"127.0.0.1:1".ljust(64, b"\0")))
            challenge = _recv_exact(sock, _CHALLENGE.size)
            sock.sendall(b"\0" * 32)  # a wrong proof
            answer = challenge
            while part := sock.recv(4096):
                answer += part
        assert len(answer) > _CHALLENGE.size  # the refusal came
        assert struct.pack("<Q", engine.engine_id) not in answer


def test_certificate_options_are_all_or_nothing(pki):
    """All three files or none; a key that is not the certificate's, or a missing file, is refused."""
    with pytest.raises(ValueError, match="all of tls_cert, tls_key and tls_ca"):
        TransferEngine(tls_cert=pki["md"].cert, tls_key=pki["md"].key)
    with pytest.raises(ValueError, match="cannot use the private key .* with the certificate .*key values mismatch"):
        TransferEngine(tls_cert=pki["md"].cert, tls_key=pki["victim"].key, tls_ca=pki["md"].ca)
    with pytest.raises(ValueError, match="cannot read the CA certificate /nonexistent"):
        TransferEngine(tls_cert=pki["md"].cert, tls_key=pki["md"].key, tls_ca="/nonexistent/ca.pem")


def test_the_tls_bench_runs_each_mode_with_its_own_credentials(tmp_path):
    """The tls bench's modes: certificates name the bench engines, the token's TLS and plain
    need none; one small loopback round of each moves the bytes and times connect()."""
    from pddcore.benchmarks import tls_cases

    kwargs = tls_cases.mode_kwargs(str(tmp_path))
    with TransferEngine(**kwargs["sink"]["cert"]) as sink, TransferEngine(**kwargs["source"]["cert"]) as source:
        assert source.connect(sink.address).engine_id == engine_id_for_name("bench-sink")
    assert kwargs["sink"]["plain"] == {} and kwargs["sink"]["tls"] == {"tls": True}
    [result] = tls_cases.loopback(1 << 20, streams_list=(1,), rounds=1, connects=2)
    assert min(result.plain_gbps, result.tls_gbps, result.cert_gbps) > 0
    assert sorted(result.connect_ms) == sorted(tls_cases.MODES)
