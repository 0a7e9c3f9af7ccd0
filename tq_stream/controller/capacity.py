"""Why a full partition stays full: the messages of a writer blocked on ``capacity``.

Rows of a partition without declared consumers are never freed by acks (they stay
until cleared, the documented rule), so once such a partition is full its writers
block and its readers run dry, whatever the consumers do. The writer's WaitTimeout,
a reader's WaitTimeout and the WARNING of a writer blocked 10 s (``Timings.wait``)
say so, with the fix. Not at once: a partition freed by ``clear`` (a replay buffer)
fills and drains all the time, and a put blocked briefly is back-pressure.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tq_stream.errors import ConfigError, WaitTimeout, format_seconds

if TYPE_CHECKING:
    from tq_stream.controller.partition import PartitionMeta


def undeclared_full(part: PartitionMeta) -> bool:
    """True if ``part`` is full and no ack can free a row of it (no declared consumers)."""
    return part.consumers is None and part.capacity is not None and \
        part.live >= part.capacity


def held_hint(part: PartitionMeta) -> str:
    """Why the rows of a full ``part`` stay, and the fix ("" unless undeclared_full)."""
    if not undeclared_full(part):
        return ""
    return (f"partition {part.name!r} is full ({part.live}/{part.capacity} rows) and has "
            f"no declared consumers, so acks free none of its rows (they stay until "
            f"cleared): declare its readers with create_partition({part.name!r}, "
            f"consumers=[...]), or free rows with client.clear / kv.clear")


def never_fits(part: PartitionMeta, n_new: int) -> ConfigError | None:
    """The error of a put of ``n_new`` rows that can never fit ``part``'s capacity (None
    if it may): more rows than the capacity, or than it leaves beside the shared entries
    no row names and no pin holds (they stay until rows naming them are freed, or a
    clear: the entries a put's rows name take their slots while it waits)."""
    cap = part.capacity
    if cap is None:
        return None
    t = part.shared
    held = int((t.entry & (t.refs == 0) & (t.holds == 0)).sum()) if t.count else 0
    if n_new + held <= cap:
        return None
    beside = (f" leaves beside the {held} slot{'s' * (held != 1)} taken by shared entries no "
              f"row names yet (each stays until the rows naming it are freed, or a clear; "
              f"the capacity counts rows and entries)") if n_new <= cap else ""
    return ConfigError(f"a put must not add more rows than the capacity {cap} of partition "
                       f"{part.name!r}{beside}, got {n_new} new rows")


def full_error(part: PartitionMeta, timeout: float) -> WaitTimeout:
    """The WaitTimeout of a put that found ``part`` full for ``timeout`` seconds."""
    why = held_hint(part) or (
        f"its declared consumers {list(part.consumers or ())} have not acked (or "
        f"discarded) enough rows to free capacity; stats()[{part.name!r}]['held'] says "
        f"who rows wait for")
    return WaitTimeout(f"partition {part.name!r} stayed full ({part.live}/{part.capacity} "
                       f"rows) for timeout={format_seconds(timeout)}: {why}")


def full_reason(part: PartitionMeta) -> str:
    """What a writer blocked on ``part`` waits for, for the WARNING logged once it has
    waited ``Timings.slow_wait`` (10) seconds: the rows held, and why no ack frees
    them when the partition has no declared consumers."""
    hint = held_hint(part)
    return f"{part.live}/{part.capacity} rows held" + (f"; {hint}" if hint else "")
