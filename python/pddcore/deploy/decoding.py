"""The decode loop RLD and MD share: requests that own a KV sequence in the role's pool,
one batched decode step over all of them, greedy/seeded sampling, stop conditions."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .. import unpack
from ..model import Model, KVPool, SamplerState, SamplingParams, SequenceKV, sample
from .kv_arrivals import KvArrivals
from .wire import KvReady

__all__ = ["Running", "DecodeLoop", "DecodeRole", "land_kv"]


@dataclass
class Running:
    """A request decoding here. ``outputs[i]`` is output token ``base + i``; the last one
    was sampled but its KV is not in ``seq`` yet (the next step feeds it)."""

    rid: str
    seq: SequenceKV
    prompt_len: int
    max_new_tokens: int
    seed: int
    base: int
    outputs: list[int] = field(default_factory=list)

    @property
    def next_index(self) -> int:
        return self.base + len(self.outputs)

    @property
    def finished(self) -> bool:
        return self.next_index >= self.max_new_tokens


def land_kv(pool: KVPool, seq: SequenceKV, note: KvReady, staging: torch.Tensor) -> None:
    """Unpacks the pages of ``note`` from the staging region into new pages of ``seq``
    (which holds exactly ``note.first_token`` tokens, page-aligned)."""
    if seq.num_tokens != note.first_token or note.first_token % pool.page_size:
        raise ValueError(f"{note.rid}: sequence holds {seq.num_tokens} tokens, the KV starts at {note.first_token}")
    pages = pool.append_external(seq, note.context_len - note.first_token)
    buf = staging[note.offset:note.offset + note.nbytes]
    unpack(pool.layout(), torch.tensor(pages, dtype=torch.int64), buf)


class DecodeLoop:
    """Batched decode over :attr:`running`; :meth:`step` returns the new tokens as
    ``(rid, output index, token)`` and moves finished requests to the caller.
    :attr:`last_step_s` is how long the latest step took (model and sampling)."""

    def __init__(self, model: Model):
        self.model = model
        self.params = SamplingParams()
        self.stops = set(model.config.eos_token_ids)
        self.running: dict[str, Running] = {}
        self.last_step_s = 0.0

    def is_done(self, r: Running) -> bool:
        return r.finished or (bool(r.outputs) and r.outputs[-1] in self.stops)

    def step(self, rids: list[str]) -> list[tuple[str, int, int]]:
        """One decode step for ``rids`` (all running and not done)."""
        if not rids:
            return []
        started = time.perf_counter()
        batch = [self.running[rid] for rid in rids]
        logits = self.model.decode([r.seq for r in batch], [r.outputs[-1] for r in batch])
        states = [SamplerState(r.seed, r.next_index) for r in batch]
        tokens = sample(logits, [self.params] * len(batch), states)
        self.last_step_s = time.perf_counter() - started
        out = []
        for r, tok in zip(batch, tokens):
            out.append((r.rid, r.next_index, tok))
            r.outputs.append(tok)
        return out

    def sample_after(self, r: Running, logits: torch.Tensor) -> tuple[str, int, int]:
        """Samples ``r``'s next token from ``logits`` [1, V] (an extend pass) and records it."""
        tok = sample(logits, [self.params], [SamplerState(r.seed, r.next_index)])[0]
        event = (r.rid, r.next_index, tok)
        r.outputs.append(tok)
        return event


class DecodeRole:
    """The event loop RLD and MD share: the front's messages, then the priority lane
    (without blocking while requests are decoding), then one decode step.

    Subclasses provide ``node``, ``loop``, ``handle_front(msg)``, ``handle_lane(message)``
    (a :class:`pddcore.transfer.Message`) and ``decode()``. Streamed KV reaches
    ``handle_lane`` as its KV-ready note once every layer landed (:class:`.KvArrivals`).
    """

    kv_arrivals: KvArrivals

    def serve(self) -> None:
        while True:
            for msg in self.node.hub_messages():
                self.handle_front(msg)
            busy = bool(self.loop.running)
            for message in self.node.engine.poll_messages(0 if busy else 0.005):
                for arrived in self.kv_arrivals.feed(message):
                    self.handle_lane(arrived)
            self.decode()
