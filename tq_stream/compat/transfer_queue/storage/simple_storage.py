"""``transfer_queue.storage.simple_storage``: the storage unit class name (see ``_actors``)."""

from tq_stream.compat.transfer_queue._actors import ActorStandIn


class SimpleStorageUnit(ActorStandIn):
    """Never started: ``transfer_queue.init`` starts tq_stream's storage units."""


__all__ = ["SimpleStorageUnit"]
