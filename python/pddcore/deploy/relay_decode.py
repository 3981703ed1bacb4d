"""The RLD role (RelayDecode): gets P's KV over the local link within milliseconds,
decodes eagerly and streams the first tokens, then hands the request to MD.

For a ``P_RLD_MD`` request, once MD says it holds the prompt's KV (``READY`` on the
priority lane), RLD asks :class:`pddcore.handoff.HandoffPolicy` what to do each step and
sends MD the **token ids** it generated (:class:`pddcore.handoff.Handoff`): one final
message (one-shot), or catch-up batches while it keeps decoding, then the final one.
RLD emits no token of a request after its final handoff: from there MD owns the output.
``RLD_ONLY`` requests (and any request whose MD side failed) finish here.

Front -> RLD: ``("stay", rid)`` (finish here), ``("released", rid)`` (MD took over),
``("md_lost",)``. RLD -> front: ``("tokens", "RLD", [(rid, index, token), ...], step_s)``
(``step_s``: the decode step's seconds; absent for a request's first token, which P sampled),
``("handoff", rid, index, mode)`` (output from ``index`` on is MD's), ``("done", rid, "RLD")``,
``("staging_free", "rld", offset)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..handoff import FINAL, Handoff, HandoffMode, HandoffPolicy, HandoffState, SamplerState
from ..transfer import Message, TransferError
from . import wire
from .decoding import DecodeLoop, DecodeRole, Running, land_kv
from .kv_arrivals import KvArrivals
from .node import Node

__all__ = ["serve"]


@dataclass
class _Relay:
    """Handoff progress of a P_RLD_MD request."""

    md_ready: bool = False
    handed: int = 0
    rounds: int = 0
    sent: list[bytes] = field(default_factory=list)


class RelayDecode(DecodeRole):
    def __init__(self, config: dict):
        self.node = Node("RLD", config)
        self.loop = DecodeLoop(self.node.model)
        self.kv_arrivals = KvArrivals()
        self.policy = HandoffPolicy(catch_up_threshold=config.get("catch_up_threshold", 64))
        self.capacity = config.get("capacity", 8)
        self.md_address = config["md_address"]
        self.md_alive = True
        self.relays: dict[str, _Relay] = {}      # running P_RLD_MD requests
        self.unconfirmed: dict[str, list[bytes]] = {}  # handed off, MD has not taken over yet
        self.corrupt_left = config.get("corrupt_handoffs", 0)
        self.early_ready: set[str] = set()

    def handle_front(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "stay":
            self.relays.pop(msg[1], None)
        elif kind == "released":
            self.unconfirmed.pop(msg[1], None)
        elif kind == "md_lost":
            self.md_alive = False
            self.relays.clear()
            self.unconfirmed.clear()

    def handle_lane(self, message: Message) -> None:
        kind, body = wire.parse(message)
        if kind == "kv":
            self.admit(body)
        elif kind == "ready":
            if body in self.relays:
                self.relays[body].md_ready = True
            elif body not in self.unconfirmed:  # MD was faster than our own landing: keep the news
                self.early_ready.add(body)
        elif kind == "nack":
            self.node.log.warning("MD rejected a handoff message (%s); re-sending %d unconfirmed handoffs",
                                  body, len(self.unconfirmed) + len(self.relays))
            for messages in [*self.unconfirmed.values(), *(r.sent for r in self.relays.values())]:
                for data in messages:
                    self.send_md(data)
        else:
            self.node.log.warning("ignored a message that is no RLD message (%s, %d bytes)", kind,
                                  len(message.payload))

    def admit(self, note: wire.KvReady) -> None:
        pool = self.node.pool
        seq = pool.new_sequence()
        land_kv(pool, seq, note, self.node.staging)
        self.node.to_hub("staging_free", "rld", note.offset)
        r = Running(note.rid, seq, note.context_len, note.max_new_tokens, note.seed, note.out_index, [note.token])
        self.loop.running[r.rid] = r
        if note.pipeline == "P_RLD_MD" and self.md_alive:
            self.relays[r.rid] = _Relay(md_ready=r.rid in self.early_ready)
        self.early_ready.discard(r.rid)
        self.node.to_hub("tokens", "RLD", [(r.rid, note.out_index, note.token)])
        if self.loop.is_done(r):
            self.finish(r)

    def decode(self) -> None:
        events = self.loop.step(list(self.loop.running))
        if events:
            self.node.to_hub("tokens", "RLD", events, self.loop.last_step_s)
        for r in list(self.loop.running.values()):
            if self.loop.is_done(r):
                self.finish(r)
            elif r.rid in self.relays:
                self.consider_handoff(r, self.relays[r.rid])

    def finish(self, r: Running) -> None:
        del self.loop.running[r.rid]
        self.relays.pop(r.rid, None)
        self.node.pool.release(r.seq)
        self.node.to_hub("done", r.rid, "RLD")

    def consider_handoff(self, r: Running, relay: _Relay) -> None:
        backlog = len(r.outputs) - relay.handed
        load = len(self.loop.running) / self.capacity
        decision = self.policy.decide(HandoffState(backlog, relay.md_ready, load, relay.rounds))
        if decision.mode is HandoffMode.WAIT or (decision.num_tokens == 0 and not decision.final):
            return
        end = relay.handed + decision.num_tokens
        sampler = SamplerState(r.seed, end, end) if decision.final else None
        msg = Handoff(r.rid, len(relay.sent), r.prompt_len + relay.handed, r.outputs[relay.handed:end],
                      FINAL if decision.final else 0, sampler)
        data = msg.encode()
        relay.sent.append(data)
        relay.handed = end
        if self.corrupt_left > 0:  # fault injection: this copy arrives malformed
            self.corrupt_left -= 1
            bad = bytearray(data)
            bad[len(bad) // 2] ^= 0x5A
            self.send_md(bytes(bad))
        else:
            self.send_md(data)
        if not decision.final:
            relay.rounds += 1
            return
        # Output ownership moves now: every token up to `end` went to the front before this line.
        self.node.to_hub("handoff", r.rid, end, "catch_up" if relay.rounds else "one_shot")
        self.unconfirmed[r.rid] = relay.sent
        del self.relays[r.rid]
        del self.loop.running[r.rid]
        self.node.pool.release(r.seq)

    def send_md(self, data: bytes) -> None:
        try:
            self.node.peers.send(self.md_address, data)
        except TransferError as e:
            self.node.log.warning("handoff to MD not sent: %s", e)


def serve(config: dict) -> None:
    RelayDecode(config).serve()
