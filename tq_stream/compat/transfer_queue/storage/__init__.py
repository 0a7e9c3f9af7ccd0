"""``transfer_queue.storage``: the storage names clients import."""

from tq_stream.errors import StateError


class StorageKeyNotFoundError(StateError):
    """TransferQueue's name for a read of a key that holds no such field."""


__all__ = ["StorageKeyNotFoundError"]
