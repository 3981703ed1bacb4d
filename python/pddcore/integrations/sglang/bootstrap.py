"""Where SGLang's prefill ranks announce themselves and decode ranks find them: the HTTP
bootstrap server (:class:`PDDKVBootstrapServer`), the prefill side's registration with it
(:func:`register_prefill_rank`) and the decode side's look-up (:func:`fetch_prefill_info`).

The table ``GET /route`` answers once the ranks registered (one ``PUT /route`` each)::

    {"ranks": {"0": "10.0.0.1:41234", "1": "10.0.0.1:41240"}, "tp_size": 2, "total_kv_heads": 8,
     "is_mla": false, "page_size": 16, "head_page_bytes": 4096}
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer
from sglang.srt.utils.network import NetworkAddress

__all__ = ["PDDKVBootstrapServer", "PrefillInfo", "bootstrap_url", "register_prefill_rank", "fetch_prefill_info"]

log = logging.getLogger(__name__)

# Pauses between the prefill's registration attempts: CommonKVManager makes 5, doubling from 1 s.
_REGISTER_RETRY_DELAYS_S = (1.0, 2.0, 4.0, 8.0)
_SHAPE_KEYS = ("tp_size", "total_kv_heads", "is_mla", "page_size", "head_page_bytes")


class PDDKVBootstrapServer(BaseKVBootstrapServer):
    """HTTP registry of prefill ranks: ``PUT /route`` (a rank registers), ``GET /route``
    (all ranks). Started by the prefill server on ``disaggregation_bootstrap_port``."""

    def __init__(self, host: str, port: int):
        table: dict[str, Any] = {"ranks": {}}
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:  # noqa: N802 (http.server naming)
                if self.path != "/route":
                    return self._reply(404, {"error": f"unknown path {self.path}"})
                try:
                    info = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                    rank, address = int(info["rank"]), str(info["address"])
                    shape = {k: info[k] for k in _SHAPE_KEYS}
                except (ValueError, KeyError, TypeError) as exc:
                    return self._reply(400, {"error": f"bad registration: {exc}"})
                with lock:
                    if table["ranks"] and any(table.get(k) != v for k, v in shape.items()):
                        return self._reply(409, {"error": f"rank {rank} disagrees with registered shape {table}"})
                    table.update(shape)
                    table["ranks"][str(rank)] = address
                self._reply(200, {"ok": True})

            def do_GET(self) -> None:  # noqa: N802
                if self.path != "/route":
                    return self._reply(404, {"error": f"unknown path {self.path}"})
                with lock:
                    self._reply(200, json.loads(json.dumps(table)))

            def log_message(self, *args: Any) -> None:
                return

        self.host, self.port = host, int(port)
        self._server = ThreadingHTTPServer((host, self.port), Handler)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="pdd-bootstrap", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _http(method: str, url: str, body: dict | None = None, timeout: float = 5.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


@dataclass(frozen=True)
class PrefillInfo:
    """A prefill server's parallel layout as its ranks registered it at the bootstrap server;
    the entries of ``PDDKVManager.prefill_info_table`` that SGLang's decode queue reads.
    ``head_page_bytes`` is one KV head's share of a page (0 for MLA)."""

    tp_size: int
    total_kv_heads: int
    is_mla: bool
    page_size: int
    ranks: dict[int, str]
    head_page_bytes: int = 0
    dp_size: int = 1
    follow_bootstrap_room: bool = True

    @property
    def attn_tp_size(self) -> int:
        return self.tp_size


def bootstrap_url(server_args: Any) -> str:
    """Where prefill ranks register, built as ``CommonKVManager.register_to_bootstrap`` does: the
    bootstrap server runs beside the first node, so multi-node ranks use ``dist_init_addr``'s host;
    on one node it is the HTTP server's ``host``, a wildcard meaning the loopback it also binds."""
    if server_args.dist_init_addr:
        host = NetworkAddress.parse(server_args.dist_init_addr).resolved().host
    else:
        host = server_args.host or "127.0.0.1"
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"{NetworkAddress(host, int(server_args.disaggregation_bootstrap_port)).to_url()}/route"


def register_prefill_rank(url: str, registration: dict[str, Any]) -> None:
    """Publishes one prefill rank (``registration``: its ``rank``, engine ``address`` and the
    :data:`_SHAPE_KEYS`) at the bootstrap server ``url``, retrying like SGLang's
    ``CommonKVManager``; raises RuntimeError once every attempt failed or the server refused."""
    rank = registration["rank"]
    attempts = len(_REGISTER_RETRY_DELAYS_S) + 1
    for attempt in range(1, attempts + 1):
        try:
            _http("PUT", url, registration)
            return
        except urllib.error.HTTPError as exc:
            if exc.code < 500:  # the server refuses this registration: another try cannot help
                raise RuntimeError(f"bootstrap server {url} refused prefill rank {rank}: "
                                   f"{exc.read().decode(errors='replace')}") from exc
            error: Exception = exc
        except (urllib.error.URLError, OSError, ValueError) as exc:
            error = exc
        log.warning("pddcore: registration attempt %d/%d at %s failed: %s", attempt, attempts, url, error)
        if attempt < attempts:
            time.sleep(_REGISTER_RETRY_DELAYS_S[attempt - 1])
    raise RuntimeError(f"prefill rank {rank} could not register at the bootstrap server {url} "
                       f"after {attempts} attempts: {error}")


def fetch_prefill_info(bootstrap_addr: str) -> PrefillInfo | None:
    """The prefill layout behind ``bootstrap_addr`` ("host:port"); None while the server is
    unreachable or not every prefill rank has registered."""
    try:
        table = _http("GET", f"http://{bootstrap_addr}/route", timeout=1.0)
    except (urllib.error.URLError, OSError, ValueError):
        return None
    if not table.get("ranks") or len(table["ranks"]) < table["tp_size"]:
        return None
    return PrefillInfo(tp_size=table["tp_size"], total_kv_heads=table["total_kv_heads"], is_mla=table["is_mla"],
                       page_size=table["page_size"], ranks={int(r): a for r, a in table["ranks"].items()},
                       head_page_bytes=table["head_page_bytes"])
