"""What every role process shares: the connection to the front (a Unix socket, which
works across network namespaces), the model, and the TransferEngine with its staging
region."""

from __future__ import annotations

import logging
import os
import sys
from multiprocessing.connection import Client, Connection
from typing import Any, Iterator

import torch

from .. import set_num_threads
from ..model import Model
from ..peer_cache import PeerCache
from ..transfer import TransferEngine

__all__ = ["Node", "load_model"]


def load_model(spec: dict) -> Model:
    """The embedded seeded model, or a Hugging Face folder (``spec["path"]``), in float64 on CPU
    unless ``spec["dtype"]`` says otherwise."""
    dtype = getattr(torch, spec.get("dtype", "float64"))
    if spec.get("path"):
        return Model.from_pretrained(spec["path"], dtype=dtype)
    return Model.default(seed=spec.get("seed", 0), dtype=dtype)


class Node:
    """A role's plumbing. ``config`` keys: ``hub`` (socket path), ``authkey`` (hex),
    ``listen`` (engine address), ``model``, ``pool_pages``, ``page_size``,
    ``staging_bytes`` (0: none), ``auth_token``."""

    def __init__(self, role: str, config: dict):
        torch.set_num_threads(1)  # tiny ops on a small shared CPU: extra threads only contend
        set_num_threads(1)
        self.role = role
        self.config = config
        logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                            format=f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(message)s")
        self.log = logging.getLogger(f"pddcore.deploy.{role}")
        self.model = load_model(config["model"])
        self.pool = self.model.new_pool(config["pool_pages"], config["page_size"])
        self.layout = self.pool.layout()
        self.engine = TransferEngine(listen=config["listen"], auth_token=config["auth_token"],
                                     timeout_s=config.get("engine_timeout_s", 30.0))
        self.peers = PeerCache(self.engine)
        self.staging = None
        self.staging_region = None
        if config.get("staging_bytes"):
            self.staging = torch.empty(config["staging_bytes"], dtype=torch.uint8)
            self.staging_region = self.engine.register(self.staging, target=True)
        self.hub: Connection = Client(config["hub"], family="AF_UNIX", authkey=bytes.fromhex(config["authkey"]))
        hello: dict[str, Any] = {"engine": self.engine.address}
        if self.staging_region is not None:
            hello["staging"] = self.staging_region.descriptor().hex()
        self.hub.send(("hello", role, hello))

    def to_hub(self, *message: Any) -> None:
        self.hub.send(message)

    def hub_messages(self) -> Iterator[tuple]:
        """Messages from the front that are waiting now. The front closing ends the process."""
        try:
            while self.hub.poll(0):
                yield self.hub.recv()
        except (EOFError, OSError):
            self.log.info("front closed the connection; exiting")
            self.close()
            raise SystemExit(0)

    def close(self) -> None:
        self.engine.close()
