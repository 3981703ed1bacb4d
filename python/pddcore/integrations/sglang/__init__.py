"""SGLang PD-disaggregation transfer backend on pddcore (tested with sglang 0.5.23).

Implements ``sglang.srt.disaggregation.base.conn``'s ``BaseKVManager`` (:mod:`.manager`),
``BaseKVSender`` (:mod:`.sender`), ``BaseKVReceiver`` (:mod:`.receiver`) and
``BaseKVBootstrapServer`` (:mod:`.bootstrap`) over :class:`pddcore.TransferEngine` (TCP),
exchanging the messages of :mod:`.protocol`:

* the prefill side's :class:`PDDKVManager` registers its engine address with the
  :class:`PDDKVBootstrapServer` (HTTP, ``disaggregation_bootstrap_port``);
* a decode :class:`PDDKVReceiver` looks the prefill ranks up there, takes one staging buffer
  per request from a pool of registered buffers, and sends each prefill rank it needs a
  registration (its page count, ``decode_prefix_len``, head range, the staging region) on the
  priority lane;
* a prefill :class:`PDDKVSender` reports ``WaitingForInput`` once every decode rank it feeds
  has registered, then on each ``send(page_indices)`` packs those pages (``pddcore.pack``,
  head-sliced when the TP sizes differ) into a pooled buffer and writes them into the decode
  staging buffer; the last chunk also carries the aux (metadata buffer) item;
* the decode side unpacks (``pddcore.unpack``) into its pages only once every chunk from every
  prefill rank was verified and applied, so a page is never half written and a peer never
  writes a KV page directly: ``Success``.

Staging buffers are pinned host memory when the KV lives on a GPU (``server_args.device``,
``KVArgs.gpu_id``), so the CUDA pack/unpack kernels read and write them directly.

States follow ``KVPoll`` exactly: Bootstrapping -> WaitingForInput -> Transferring ->
Success | Failed; ``failure_exception()`` raises :class:`PDDTransferError` after ``Failed``.
An abort on either side fails the peer's side as well; a malformed message fails only the
request it names.

Addresses follow SGLang's ``CommonKVManager``: the engine listens on, and publishes, the
local IP that ``sglang.srt.utils.network.get_local_ip_auto`` finds (``SGLANG_HOST_IP`` /
``HOST_IP``, ``SGLANG_LOCAL_IP_NIC``, else the default route's source address), or
``PDDCORE_SGLANG_HOST`` when set; prefill ranks register at the bootstrap server on
``dist_init_addr``'s host (multi-node) or ``--host`` (0.0.0.0 meaning this machine).

SGLang picks its backend from a closed enum; :func:`install` (:mod:`.plugin`) adds ``"pddcore"`` through
SGLang's plugin hook registry (``sglang.srt.plugins``; pddcore declares the entry point, so
``--disaggregation-transfer-backend pddcore`` works once pddcore is installed).
Refused when the manager is built (:func:`~.config.check_supported`): DP attention, pipeline
parallelism, an EAGLE draft KV pool. Not covered (a request that needs them fails with a clear
reason): per-request state buffers (``state_indices``: Mamba/SWA/DSA), PD rebootstrap (``submit_prefill_recompute``), and the mooncake-only extras
(SGLang's staging handler, HiCache host destinations). A prefill request no decode rank
registers for fails after ``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` seconds.
"""

from .bootstrap import PDDKVBootstrapServer, PrefillInfo, _http, bootstrap_url
from .config import HOST_ENV, advertised_host, kv_device
from .manager import PDDKVManager
from .plugin import BACKEND_NAME, install
from .protocol import MAGIC as _MAGIC
from .protocol import MESSAGES
from .receiver import PDDKVReceiver
from .sender import PDDKVSender
from .states import PDDTransferError

# _MAGIC, _encode and _http: what the integration tests forge messages and read the
# bootstrap table with.
_encode = MESSAGES.encode

__all__ = ["PDDKVManager", "PDDKVSender", "PDDKVReceiver", "PDDKVBootstrapServer", "PDDTransferError",
           "PrefillInfo", "install", "kv_device", "advertised_host", "bootstrap_url", "BACKEND_NAME", "HOST_ENV"]
