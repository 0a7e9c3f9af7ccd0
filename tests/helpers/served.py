"""A Controller behind the RPC table of its service's puts and reads, for dispatcher
tests that need no storage units (``ControllerService`` serves the whole table)."""

from __future__ import annotations

from tq_stream.controller import Controller
from tq_stream.messages import puts, reads
from tq_stream.messages.rpc import RpcTable
from tq_stream.transport.handler import Methods

TABLE = RpcTable(puts.RPCS, reads.RPCS)


class Served:
    """Serves ``controller``'s methods of ``TABLE`` with its flags."""

    # TABLE's methods and flags without its signature check: tests wrap methods
    RPC_TABLE = Methods(TABLE.methods, inline=TABLE.inline, waits=TABLE.waits,
                        replies=TABLE.replies)

    def __init__(self, controller: Controller) -> None:
        for name in TABLE.methods:
            setattr(self, name, getattr(controller, name))
