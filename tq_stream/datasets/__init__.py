"""Datasets: the StreamingDataset and the batch helpers it yields with."""

from tq_stream.datasets.batch import batch_meta, select_rows, split_rows
from tq_stream.datasets.streaming import StreamingDataset

__all__ = ["StreamingDataset", "batch_meta", "select_rows", "split_rows"]
