"""TransferQueue's ``get_meta(mode="fetch")`` and consumption status, on tq_stream tasks.

TransferQueue hands each task (``task_name``) every row once: ``get_meta`` takes the
oldest ready rows (all of ``data_fields`` written) the task has not consumed
(SequentialSampler) and marks them consumed at once. Here a task is a tq_stream task of
the partition, registered on the first ``get_meta`` with its fields and batch size; each
call takes the next step (``step=None``) and acks it at once, so a row goes to a task
exactly once, atomically in the controller, from any process.

- Too few ready rows: an empty BatchMeta at once under ``controller.polling_mode``,
  else a wait of up to ``tq_stream.timeout`` seconds (``WaitTimeout``).
- A task keeps its fields and batch size: another ``data_fields`` or ``batch_size``
  for the same task and partition is a ConfigError (TransferQueue would re-scan).
- ``sampling_config`` (``dp_rank``, ...) is accepted and, as by TransferQueue's
  SequentialSampler, not used.
- A field stored under several physical names (``variants``): the task reads the one
  that holds rows; it is registered only once one does (until then the task waits, or
  polls empty), and a new physical name appearing later is a ConfigError, not a wait
  that cannot end.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from tq_stream.compat import variants
from tq_stream.compat.meta import BatchMeta
from tq_stream.compat.runtime import Runtime
from tq_stream.errors import ConfigError, WaitTimeout, format_seconds

POLL_S = 0.05  # how often a waiting get_meta looks for its fields before its task exists
NOW_S = 1e-3  # the wait of a polling-mode get_meta on its task


def _physical(rt: Runtime, partition: str, fields: Sequence[str]) -> list[str] | None:
    """The stored name each of ``fields`` has in live rows, None while one has none.

    Raises:
        ConfigError: a field holds rows under two names (written with two types).
    """
    stream = rt.get()
    fixed = rt.schemas.refresh(stream, partition)
    cands = {f: [p for p in fixed if variants.logical(p) == f] for f in fields}
    if not all(cands.values()):
        return None  # a field nobody wrote yet: its name is not known
    live: set[str] = set()  # (a name whose rows were all cleared, e.g. a warm-up row,
    # may not be the one the next rows use)
    for row in stream.kv.list(partition=partition):
        live.update(row["fields"])
    out = []
    for f, c in cands.items():
        held = [p for p in c if p in live]
        if len(held) > 1:
            raise ConfigError(f"data_fields must each hold one type to be fetched, but field "
                              f"{f!r} of partition {partition!r} holds rows as {held}")
        if not held:
            return None
        out.append(held[0])
    return out


def _task(rt: Runtime, partition: str, task: str, fields: list[str],
          batch_size: int) -> list[str] | None:
    """The physical fields of ``task`` (registering it once they are known)."""
    known = rt.tasks.get((partition, task))
    if known is not None:
        if (list(known[0]), known[1]) != (fields, batch_size):
            raise ConfigError(f"data_fields and batch_size of task {task!r} on partition "
                              f"{partition!r} must stay {list(known[0])} and {known[1]}, got "
                              f"{fields} and {batch_size}")
        return list(known[2])
    phys = _physical(rt, partition, fields)
    if phys is None:
        return None
    rt.native_client().register_task(partition, task, fields=phys, batch_size=batch_size)
    rt.tasks[(partition, task)] = (tuple(fields), batch_size, tuple(phys))
    rt.task_names[(partition, task)] = frozenset(rt.schemas.fixed(partition))
    return phys


def _check_names(rt: Runtime, partition: str, task: str, fields: list[str],
                 phys: list[str]) -> None:
    """Raise if a field got a stored name (rows of another type) after the task began."""
    before = rt.task_names.get((partition, task), frozenset())
    fixed = rt.schemas.refresh(rt.get(), partition)
    for f, p in zip(fields, phys, strict=True):
        other = [q for q in fixed if variants.logical(q) == f and q != p and q not in before]
        if other:
            raise ConfigError(f"field {f!r} of partition {partition!r} was also written as "
                              f"{other} after the task began reading it as {p!r}; write one "
                              f"type per field for get_meta")


def get_meta(rt: Runtime, data_fields: Sequence[str], batch_size: int, partition: str,
             mode: str, task_name: str | None) -> BatchMeta:
    """See the module docstring."""
    if mode != "fetch":
        raise ConfigError(f"mode must be 'fetch' under tq_stream.compat (insert and "
                          f"force_fetch are not implemented), got {mode!r}")
    if not task_name:
        raise ConfigError(f"task_name must name the consumer task, got {task_name!r}")
    fields = [data_fields] if isinstance(data_fields, str) else list(data_fields)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
    timeout = rt.get().config.timeout
    deadline = time.monotonic() + timeout
    while True:
        phys = _task(rt, partition, task_name, fields, batch_size)
        if phys is not None:
            break
        if rt.polling:
            return BatchMeta()
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"get_meta waited {format_seconds(timeout)} for fields "
                              f"{fields} of partition {partition!r} to be written "
                              f"(tq_stream.timeout)")
        time.sleep(POLL_S)
    client = rt.native_client()
    wait = NOW_S if rt.polling else max(deadline - time.monotonic(), NOW_S)
    try:
        meta = client.get_meta(partition, task_name, timeout=wait)
    except WaitTimeout:
        if not rt.polling:
            raise
        _check_names(rt, partition, task_name, fields, phys)
        return BatchMeta()
    if meta is None or meta.end or not len(meta):
        return BatchMeta()
    client.ack(meta)
    schema = {f: meta.schemas[p].to_dict() if p in meta.schemas else {}
              for f, p in zip(fields, phys, strict=True)}
    return BatchMeta([int(i) for i in meta.index], [partition] * len(meta), schema,
                     custom_meta=[dict(t) for t in meta.tags], keys=list(meta.keys))


def consumed(rt: Runtime, task_name: str, partition: str) -> bool:
    """True iff ``partition`` has rows and ``task_name`` has consumed every one."""
    stream = rt.get()
    stats = stream.stats().get(partition)
    if stats is None or not stats["rows"]:
        return False
    rows = rt.native_client().task_rows(partition, task_name)
    return bool(rows["exists"]) and rows["remaining"] == 0 and rows["formed"] > 0
