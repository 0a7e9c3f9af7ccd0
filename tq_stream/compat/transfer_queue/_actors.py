"""Stand-ins for TransferQueue's Ray actor classes, under their import paths.

Clients import ``transfer_queue.controller.TransferQueueController`` and
``transfer_queue.storage.simple_storage.SimpleStorageUnit`` to wrap their
``.options`` (NeMo-RL adds a Ray ``runtime_env`` that way). tq_stream starts its own
controller and storage units in ``init``; these classes are never started, so such a
patch changes nothing. Starting one is refused with an error that says so.
"""

from __future__ import annotations

from typing import Any

from tq_stream.errors import StateError


class _Options:
    """What ``Cls.options(...)`` returns: its ``remote()`` is refused."""

    def __init__(self, name: str, kwargs: dict[str, Any]) -> None:
        self.name = name
        self.kwargs = kwargs

    def remote(self, *args: object, **kwargs: object) -> None:
        raise StateError(f"{self.name} is not started by hand under tq_stream: "
                         f"transfer_queue.init(conf) starts tq_stream's controller and "
                         f"storage units")


class ActorStandIn:
    """A class with TransferQueue's actor-class surface (``options``, ``remote``)."""

    @classmethod
    def options(cls, *args: Any, **kwargs: Any) -> _Options:
        return _Options(cls.__name__, dict(kwargs))

    @classmethod
    def remote(cls, *args: object, **kwargs: object) -> None:
        cls.options().remote(*args, **kwargs)
