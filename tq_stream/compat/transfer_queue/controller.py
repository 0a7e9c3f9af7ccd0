"""``transfer_queue.controller``: the controller class name clients import (see ``_actors``)."""

from tq_stream.compat.transfer_queue._actors import ActorStandIn


class TransferQueueController(ActorStandIn):
    """Never started: ``transfer_queue.init`` starts tq_stream's controller."""


__all__ = ["TransferQueueController"]
