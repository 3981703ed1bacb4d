"""The client driver: plays the agentic trace against the front, closed-loop per session
(a turn is sent ``think_s`` after the previous answer finished, its context being the
previous context + that answer + the new user tokens), and records when every token
arrives. It checks on its own side that each request's tokens come exactly once and in
order, and writes everything to ``config["results"]`` (JSON) at the end."""

from __future__ import annotations

import json
import time
from multiprocessing.connection import Client

from .trace import Session

__all__ = ["serve"]


def serve(config: dict) -> None:
    sessions = [Session(s["sid"], s["start_s"], tuple(s["first_context"]), tuple(map(tuple, s["followups"])),
                        tuple(s["outputs"])) for s in config["scenario"]["sessions"]]
    think_s = config["scenario"]["think_s"]
    front = Client(config["hub"], family="AF_UNIX", authkey=bytes.fromhex(config["authkey"]))
    front.send(("hello", "client", {}))
    while front.recv()[0] != "ready":
        pass
    t0 = time.monotonic()
    due = {s.sid: s.start_s for s in sessions}
    turn = {s.sid: 0 for s in sessions}
    context = {s.sid: list(s.first_context) for s in sessions}
    records: dict[str, dict] = {}
    active: dict[str, int] = {}
    errors: list[str] = []
    total = sum(len(s.outputs) for s in sessions)
    by_sid = {s.sid: s for s in sessions}
    while sum(r["done"] for r in records.values()) < total:
        now = time.monotonic() - t0
        for sid, when in list(due.items()):
            if when is not None and now >= when:
                s, k = by_sid[sid], turn[sid]
                rid = f"s{sid}t{k}"
                records[rid] = {"rid": rid, "session": sid, "turn": k, "context": context[sid],
                                "max_new_tokens": s.outputs[k], "submitted": now, "times": [], "tokens": [],
                                "roles": [], "done": False, "finished_by": None}
                active[rid] = sid
                due[sid] = None
                front.send(("submit", rid, context[sid], s.outputs[k], 0))
        if not front.poll(0.002):
            continue
        msg = front.recv()
        now = time.monotonic() - t0
        if msg[0] == "tokens":
            for rid, index, token, role in msg[1]:
                rec = records[rid]
                if index != len(rec["tokens"]):
                    errors.append(f"{rid}: got token {index} after {len(rec['tokens'])} tokens")
                    continue
                rec["tokens"].append(token)
                rec["times"].append(now)
                rec["roles"].append(role)
        elif msg[0] == "done":
            rid, by = msg[1], msg[2]
            rec = records[rid]
            rec["done"], rec["finished_by"], rec["finished"] = True, by, now
            sid = active.pop(rid)
            s, k = by_sid[sid], turn[sid] + 1
            if k < len(s.outputs):
                turn[sid] = k
                context[sid] = context[sid] + rec["tokens"] + list(s.followups[k - 1])
                due[sid] = now + think_s
    with open(config["results"], "w") as f:
        json.dump({"requests": list(records.values()), "errors": errors, "wall_s": time.monotonic() - t0}, f)
    front.close()
