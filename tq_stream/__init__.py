"""tq_stream: streaming data between the stages of RL post-training.

    import tq_stream as tq
    stream = tq.init()                         # embedded; mode="local" / "ray" for more
    stream.writer("train").put(keys, td, tags=[...])
    ds = tq.StreamingDataset(stream, "train", "actor", ["input_ids"], batch_size=16)
    for batch in tq.StreamingDataLoader(ds): ...

Importing this package loads neither ray nor zmq.
"""

import logging as _logging

from tq_stream import errors, samplers
from tq_stream._version import __version__
from tq_stream.client import Client
from tq_stream.columns import FieldSchema, Ragged
from tq_stream.config import StreamConfig
from tq_stream.dataloader import StreamingDataLoader
from tq_stream.datasets import StreamingDataset, batch_meta, select_rows, split_rows
from tq_stream.deploy import connect, init
from tq_stream.kv import KV
from tq_stream.meta import BatchMeta
from tq_stream.stream import Stream
from tq_stream.writer import Writer

__all__ = [
    "KV",
    "BatchMeta",
    "Client",
    "FieldSchema",
    "Ragged",
    "Stream",
    "StreamConfig",
    "StreamingDataLoader",
    "StreamingDataset",
    "Writer",
    "__version__",
    "batch_meta",
    "connect",
    "errors",
    "init",
    "samplers",
    "select_rows",
    "split_rows",
]

# A library adds no handler of its own: its records go wherever the application's
# logging sends them (nowhere, and no "no handler" notice, until it configures some).
_logging.getLogger(__name__).addHandler(_logging.NullHandler())
