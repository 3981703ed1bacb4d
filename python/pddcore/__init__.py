"""pddcore: the transfer and kernel layer for cross-datacenter Prefill / RelayDecode /
MainDecode (PDD) disaggregated LLM inference. See README.md and DESIGN.md."""

from importlib.metadata import PackageNotFoundError, version as _version

from .layout import KVLayout, PlaneInfo
from .pack import PackPlan, get_num_threads, pack, set_num_threads, unpack
from .transfer import Message, Peer, Region, Transfer, TransferEngine, TransferError

try:
    __version__ = _version("pddcore")
except PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = ["KVLayout", "PlaneInfo", "pack", "unpack", "PackPlan", "set_num_threads", "get_num_threads", "__version__",
           "TransferEngine", "Region", "Peer", "Transfer", "TransferError", "Message"]
