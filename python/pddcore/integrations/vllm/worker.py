"""The worker side of :class:`~pddcore.integrations.vllm.PDDConnector`: both halves, since a
vLLM worker may produce and consume (``kv_both``). Each half is a subclass of
:class:`~.base_worker.WorkerBase` (pull in :mod:`.producer` and :mod:`.consumer`, push mode
on top of each in :mod:`.push_producer` and :mod:`.push_consumer`); this class only joins
them, and every method each adds cooperates through ``super()``::

    WorkerSide -> PushProducer -> ProducerWorker -> PushConsumer -> ConsumerWorker -> WorkerBase
"""

from __future__ import annotations

from .push_consumer import PushConsumer
from .push_producer import PushProducer

__all__ = ["WorkerSide"]


class WorkerSide(PushProducer, PushConsumer):
    """The connector's worker-role methods; see :class:`~.base_worker.WorkerBase` for what
    :class:`PDDConnector` sets before :meth:`_init_worker`."""
