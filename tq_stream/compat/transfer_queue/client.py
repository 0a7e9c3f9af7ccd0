"""``transfer_queue.client``: the client class under TransferQueue's path."""

from tq_stream.compat.client import TransferQueueClient

AsyncTransferQueueClient = TransferQueueClient

__all__ = ["AsyncTransferQueueClient", "TransferQueueClient"]
