"""tq_stream: streaming data between the stages of RL post-training.

    import tq_stream as tq
    stream = tq.init()                         # embedded; mode="local" / "ray" for more
    stream.writer("train").put(keys, td, tags=[...])
    ds = tq.StreamingDataset(stream, "train", "actor", ["input_ids"], batch_size=16)
    for batch in tq.StreamingDataLoader(ds): ...

Importing this package loads neither ray nor zmq. The public names are loaded on
first use (PEP 562), so a server process (which imports ``tq_stream.deploy.server``)
never loads tensordict and the parts of torch it pulls in: several seconds less per
process started (see README, "Start-up time").
"""

import importlib as _importlib
import logging as _logging
import typing as _typing

from tq_stream._version import __version__

if _typing.TYPE_CHECKING:
    from tq_stream import errors, samplers
    from tq_stream.client import Client
    from tq_stream.columns import Ragged
    from tq_stream.config import StreamConfig
    from tq_stream.dataloader import StreamingDataLoader
    from tq_stream.datasets import StreamingDataset, batch_meta, select_rows, split_rows
    from tq_stream.deploy import connect, init
    from tq_stream.kv import KV
    from tq_stream.media import MediaRef
    from tq_stream.meta import BatchMeta
    from tq_stream.multiragged import MultiRagged
    from tq_stream.schemas import FieldSchema
    from tq_stream.stream import Stream
    from tq_stream.writer import Writer

__all__ = [
    "KV",
    "BatchMeta",
    "Client",
    "FieldSchema",
    "MediaRef",
    "MultiRagged",
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

_HOME = {  # public name -> the module that defines it
    "KV": "tq_stream.kv",
    "BatchMeta": "tq_stream.meta",
    "Client": "tq_stream.client",
    "FieldSchema": "tq_stream.columns",
    "MediaRef": "tq_stream.media",
    "MultiRagged": "tq_stream.multiragged",
    "Ragged": "tq_stream.columns",
    "Stream": "tq_stream.stream",
    "StreamConfig": "tq_stream.config",
    "StreamingDataLoader": "tq_stream.dataloader",
    "StreamingDataset": "tq_stream.datasets",
    "Writer": "tq_stream.writer",
    "batch_meta": "tq_stream.datasets",
    "connect": "tq_stream.deploy",
    "init": "tq_stream.deploy",
    "select_rows": "tq_stream.datasets",
    "split_rows": "tq_stream.datasets",
}
_SUBPACKAGES = ("errors", "samplers")

# A library adds no handler of its own: its records go wherever the application's
# logging sends them (nowhere, and no "no handler" notice, until it configures some).
_logging.getLogger(__name__).addHandler(_logging.NullHandler())


def __getattr__(name: str) -> object:
    if name in _SUBPACKAGES:
        value = _importlib.import_module(f"tq_stream.{name}")
    elif name in _HOME:
        value = getattr(_importlib.import_module(_HOME[name]), name)
    else:
        raise AttributeError(f"module 'tq_stream' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
