"""``transfer_queue.metadata``: BatchMeta and KVBatchMeta under TransferQueue's path."""

from tq_stream.compat.meta import BatchMeta, KVBatchMeta

__all__ = ["BatchMeta", "KVBatchMeta"]
