"""KV: a Redis-like facade over the same controller and storage.

Example:
    >>> stream.kv.put("traj-1", {"prompt": "hi", "reward": torch.tensor(1.0)}, tag={"v": 3})
    >>> stream.kv.get("traj-1", fields=["reward"])
    {'reward': tensor(1.)}
    >>> stream.kv.get_batch(["traj-1"])       # a TensorDict of batch size [1]
    >>> stream.kv.list()                       # [{'key': 'traj-1', 'tags': {...}, 'fields': [...]}]
    >>> stream.kv.clear(["traj-1"])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tensordict import TensorDict

from tq_stream import fieldpath, shared_read
from tq_stream.backends.base import occupancy
from tq_stream.checks import TagsIn, check_fields, check_keys, check_tag
from tq_stream.connection import placement
from tq_stream.connection.connection import Connection
from tq_stream.convert import RowData, to_tensordict
from tq_stream.errors import ConfigError, check_name
from tq_stream.meta import BatchMeta
from tq_stream.writer import Writer

DEFAULT_PARTITION = "default"


class KV:
    """Key-value access to rows (see module docstring).

    Args:
        connection: the deployment (``stream.connection``); ``stream.kv`` is one.
    """

    def __init__(self, connection: Connection) -> None:
        self._conn = connection

    def put(self, key: str, fields: RowData, tag: dict[str, Any] | None = None,
            partition: str = DEFAULT_PARTITION, timeout: float | None = None,
            shared: str | None = None) -> list[str]:
        """Set the fields (and merge the tags) of one row; returns ``[key]`` if its row
        was lost with its storage unit and the put was skipped (``Writer.put``).
        ``shared``: the key of a shared entry the row reads as its own fields."""
        if not isinstance(key, str):
            raise ConfigError(f"key must be a str (use put_batch for many), got {key!r}")
        check_tag(tag)  # named as the caller wrote it, before the writer's check of tags
        return Writer(self._conn, partition).put(key, fields, tags=tag, timeout=timeout,
                                                 shared=shared)

    def put_batch(self, keys: Sequence[str], data: RowData, tags: TagsIn = None,
                  partition: str = DEFAULT_PARTITION, timeout: float | None = None,
                  shared: Sequence[str | None] | None = None) -> list[str]:
        """Set fields of many rows: ``data`` is a TensorDict ``[n]`` or dict of fields.
        Returns the keys skipped as rows lost with their storage unit (``Writer.put``)."""
        return Writer(self._conn, partition).put(check_keys(keys), data, tags=tags,
                                                  timeout=timeout, shared=shared)

    def put_shared(self, keys: str | Sequence[str], data: object,
                   partition: str = DEFAULT_PARTITION,
                   timeout: float | None = None) -> list[str]:
        """Write shared entries that rows name with ``shared=`` (``Writer.put_shared``)."""
        return Writer(self._conn, partition).put_shared(keys, data, timeout=timeout)

    def meta(self, keys: Sequence[str], fields: Sequence[str] | None = None,
             partition: str = DEFAULT_PARTITION) -> BatchMeta:
        """Where ``keys`` live, checking ``fields`` are written (all written fields if None)."""
        keys = check_keys(keys)
        d = self._conn.controller().lookup(
            partition=check_name("partition", partition), keys=keys,
            fields=check_fields(fields))
        return BatchMeta.from_reply(d)

    def locate(self, keys: Sequence[str],
               partition: str = DEFAULT_PARTITION) -> tuple[BatchMeta, dict[str, int]]:
        """Where ``keys`` live (a BatchMeta with no fields and no tags) and, for each
        field some of them hold, how many do: one controller call for a reader that
        picks its fields from what the rows hold, then ``read``s them."""
        d = self._conn.controller().locate(partition=check_name("partition", partition),
                                           keys=check_keys(keys))
        return BatchMeta.from_reply(d), dict(d.held)

    def read(self, meta: BatchMeta, fields: Sequence[str],
             ragged: str = "nested", shared: str = "rows") -> TensorDict:
        """``fields`` (each written for every row) of ``meta``'s rows as a TensorDict
        ``[n]``, rows in ``meta`` order; ``shared`` as in ``Client.get_data``."""
        if meta.shared is not None or shared != "rows":
            return shared_read.read(self._conn.units(), meta, fields, ragged, shared)
        cols = placement.load(self._conn.units(), meta.partition, meta.unit, meta.slot,
                              list(fields), occupancy(meta.index, meta.generation),
                              meta.schemas)
        return to_tensordict(cols, len(meta), ragged=ragged)

    def get_batch(self, keys: Sequence[str], fields: Sequence[str] | None = None,
                  partition: str = DEFAULT_PARTITION, ragged: str = "nested",
                  shared: str = "rows") -> TensorDict:
        """The fields of many rows as a TensorDict ``[n]`` (rows in ``keys`` order)."""
        meta = self.meta(keys, fields, partition)
        return self.read(meta, meta.fields, ragged, shared)

    def get(self, key: str, fields: Sequence[str] | None = None,
            partition: str = DEFAULT_PARTITION) -> dict[str, Any]:
        """The fields of one row as a dict (tensors without a batch dim); a parent path
        in ``fields`` (``"obs"``) gives the fields under it as a nested TensorDict."""
        if not isinstance(key, str):
            raise ConfigError(f"key must be a str (use get_batch for many), got {key!r}")
        meta = self.meta([key], fields, partition)
        cols = shared_read.columns(self._conn.units(), meta, meta.fields)
        out: dict[str, Any] = {}
        for f, c in cols.items():
            out[f] = c.row(0) if hasattr(c, "row") else c[0]
        return out if fields is None else _nest_parents(out, fields)

    def list(self, partition: str = DEFAULT_PARTITION,
             keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Every row of ``partition``: ``{"key", "tags", "fields"}``, oldest first;
        with ``keys``, only theirs, in ``keys`` order (a key with no row left out)."""
        partition = check_name("partition", partition)
        only = None if keys is None else check_keys(keys)
        return self._conn.controller().list_rows(partition=partition, keys=only)

    def clear(self, keys: str | Sequence[str] | None = None,
              partition: str = DEFAULT_PARTITION) -> int:
        """Delete rows (all rows of the partition if ``keys`` is None); returns the count."""
        keys_ = None if keys is None else check_keys([keys] if isinstance(keys, str) else keys)
        return self._conn.controller().clear(partition=check_name("partition", partition),
                                                keys=keys_)


def _nest_parents(row: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``row`` (values by field) with the fields under each parent path of ``names``
    (``"obs"``) gathered into a nested TensorDict ``row["obs"]`` (no batch dim)."""
    for name in names:
        below = [f for f in fieldpath.under(name, row) if f != name]
        if below:
            sub = TensorDict({}, batch_size=[])
            for f in below:
                sub[tuple(f[len(name) + 1:].split(fieldpath.SEP))] = row.pop(f)
            row[name] = sub
    return row
