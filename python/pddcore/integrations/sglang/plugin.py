"""How SGLang finds this backend: :func:`install` makes ``--disaggregation-transfer-backend
pddcore`` select the classes of :mod:`pddcore.integrations.sglang`. pddcore declares it as
its ``sglang.srt.plugins`` entry point, so every SGLang process calls it.

Example (an ``sglang.Engine`` started from Python, without the plugin loader)::

    install()
    engine = sglang.Engine(model_path=..., disaggregation_transfer_backend=BACKEND_NAME, ...)
"""

from __future__ import annotations

import logging

from sglang.srt.disaggregation.base.conn import KVArgs

from .bootstrap import PDDKVBootstrapServer
from .manager import PDDKVManager
from .receiver import PDDKVReceiver
from .sender import PDDKVSender

__all__ = ["BACKEND_NAME", "install"]

log = logging.getLogger(__name__)

BACKEND_NAME = "pddcore"


def install() -> None:
    """Makes ``--disaggregation-transfer-backend pddcore`` select these classes.

    Adds ``pddcore`` to the CLI's choices, then, since SGLang's ``TransferBackend`` is a closed
    enum and ``get_kv_class`` a fixed table, registers through SGLang's own hook registry
    (``sglang.srt.plugins.hook_registry``) a REPLACE of the enum by one with a ``PDDCORE``
    member and an AROUND hook on ``get_kv_class`` that answers for it; every other backend is
    untouched. Idempotent. pddcore's ``sglang.srt.plugins`` entry point calls this in every
    SGLang process. Where ``sglang.srt.disaggregation.utils`` does not import (it pulls in
    every model config, some of which need torchvision), the choice is still added: the
    scheduler processes, which cannot run without that module, hook the classes.
    """
    from enum import Enum

    from sglang.srt.arg_groups.choices import DISAGG_TRANSFER_BACKEND_CHOICES, add_disagg_transfer_backend_choices

    if BACKEND_NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([BACKEND_NAME])
    try:
        from sglang.srt.disaggregation import utils as disagg_utils
    except ImportError as exc:
        log.info("pddcore: SGLang's disaggregation code does not import in this process (%s); the "
                 "backend's classes are hooked in the processes that import it", exc)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    current = disagg_utils.TransferBackend
    if "PDDCORE" not in current.__members__:
        extended = Enum("TransferBackend", {**{m.name: m.value for m in current}, "PDDCORE": BACKEND_NAME},
                        module=current.__module__)
        HookRegistry.register("sglang.srt.disaggregation.utils.TransferBackend", extended, HookType.REPLACE)
        classes = {"MANAGER": PDDKVManager, "SENDER": PDDKVSender, "RECEIVER": PDDKVReceiver,
                   "BOOTSTRAP_SERVER": PDDKVBootstrapServer, "KVARGS": KVArgs}

        def get_kv_class(original, transfer_backend, class_type):
            if getattr(transfer_backend, "value", transfer_backend) == BACKEND_NAME:
                return classes[class_type.name]
            return original(transfer_backend, class_type)

        HookRegistry.register("sglang.srt.disaggregation.utils.get_kv_class", get_kv_class, HookType.AROUND)
    HookRegistry.apply_hooks()
