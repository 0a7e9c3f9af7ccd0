"""The model of tests/integration/faults/test_model_unit_loss.py: what each row of one partition
is, when storage units die between the two puts of its rows (README "Failures", a
storage unit), as plain bookkeeping that calls nothing in tq_stream.

A row is written in two puts (``x``, then ``r``); task ``t`` reads both. A row is
``stored`` (``x``, or ``x`` and ``r``), ``held`` (handed to a reader, not acked),
``acked`` (freed: ``t`` is the only declared consumer), ``lost`` (its unit died
before it was acked) or ``tail`` (left over at the end: fewer than one per DP rank,
discarded by the sampler). Every row ends acked or lost, never both, never half made again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

FIELDS = ("x", "r")


@dataclass(eq=False)
class Row:
    unit: int
    fields: set[str] = field(default_factory=lambda: {"x"})
    state: str = "stored"  # stored | held | acked | lost | tail


class Model:
    """The rows of the partition and what the deployment must say of them."""

    def __init__(self, dp_size: int) -> None:
        self.rows: dict[str, Row] = {}
        self.told = 0  # rows lost with their unit that puts named, and were told about
        self.dead: set[int] = set()  # units killed and not restarted yet
        self.closed = False
        self.next_step = [0] * dp_size  # the step each rank reads next (lockstep)
        self.ended = [False] * dp_size

    # ------------------------------------------------------------------ writes
    def put_x(self, keys: Sequence[str], units: Sequence[int]) -> None:
        """New rows on ``units``. A unit killed and not yet declared lost may take rows
        (a same-host put writes its shared memory): they are lost with it."""
        for k, u in zip(keys, units, strict=True):
            assert k not in self.rows
            self.rows[k] = Row(u, state="lost" if u in self.dead else "stored")

    def put_r(self, keys: Iterable[str]) -> set[str]:
        """The put of ``r``: returns the keys it must skip (lost with their unit)."""
        skipped = set()
        for k in keys:
            row = self.rows[k]
            if row.state == "lost":
                skipped.add(k)
            else:
                assert row.state == "stored", (k, row)
                row.fields.add("r")
        self.told += len(skipped)
        return skipped

    def missing_r(self) -> list[str]:
        """Keys of rows that had ``x`` only (lost ones too: their put is skipped)."""
        return [k for k, row in self.rows.items() if row.fields == {"x"}]

    # ------------------------------------------------------------------ units
    def kill(self, unit: int) -> list[str]:
        """Unit ``unit`` dies: every row there not acked is lost. Returns their keys."""
        self.dead.add(unit)
        lost = [k for k, row in self.rows.items()
                if row.unit == unit and row.state in ("stored", "held")]
        for k in lost:
            self.rows[k].state = "lost"
        return lost

    def back(self, unit: int) -> None:
        self.dead.discard(unit)

    # ------------------------------------------------------------------ reads
    def deliver(self, keys: Sequence[str]) -> None:
        for k in keys:
            row = self.rows.get(k)
            assert row is not None, f"a row never written came: {k}"
            assert row.state == "stored", f"row {k} came while {row.state}"
            assert row.fields == set(FIELDS), f"row {k} came with fields {row.fields}"
            row.state = "held"

    def ack(self, keys: Sequence[str]) -> int:
        """Rows of a held batch acked; returns how many became acked (lost ones not)."""
        n = 0
        for k in keys:
            row = self.rows[k]
            if row.state == "held":
                row.state = "acked"
                n += 1
            else:
                assert row.state == "lost", (k, row)
        return n

    def tail(self, dp_size: int) -> list[str]:
        """The end came: the rows not delivered are the sampler's leftovers (fewer than
        one per rank). Returns their keys."""
        left = [k for k, row in self.rows.items() if row.state in ("stored", "held")]
        assert len(left) < dp_size, f"the partition ended before rows {left} came"
        for k in left:
            self.rows[k].state = "tail"
        return left

    def _tail_formed(self, stats: Mapping[str, Any], listed: Mapping[str, Any]) -> None:
        """After the close, a rank reading ahead may have formed the last step: rows
        left over then (fewer than one per rank) are discarded as "tail"."""
        formed = stats["tasks"]["t"]["discarded"].get("tail", 0) - self.count("tail")
        gone = [k for k, row in self.rows.items() if row.state == "stored" and k not in listed]
        if self.closed and gone and formed == len(gone) < len(self.ended):
            for k in gone:
                self.rows[k].state = "tail"

    # ------------------------------------------------------------------ counts
    def count(self, state: str) -> int:
        return sum(row.state == state for row in self.rows.values())

    def stored(self) -> dict[str, set[str]]:
        """The rows the partition must list, with their fields."""
        return {k: row.fields for k, row in self.rows.items()
                if row.state in ("stored", "held")}

    def check(self, stats: Mapping[str, Any], listed: Mapping[str, Sequence[str]]) -> None:
        """``stats()[p]`` and ``kv.list(p)`` agree with the model: nothing freed early,
        no half row made again, every lost row counted once, and once more for each
        put (not each retry of a put) that named it."""
        self._tail_formed(stats, listed)
        want = self.stored()
        assert set(listed) == set(want), (
            f"freed early: {sorted(set(want) - set(listed))[:5]}; made again or never "
            f"freed: {sorted(set(listed) - set(want))[:5]}")
        for k, fields in listed.items():
            assert set(fields) == want[k], (k, fields, want[k])
        lost, tail = self.count("lost"), self.count("tail")
        task = stats["tasks"]["t"]
        assert stats["rows"] == len(want), (stats["rows"], len(want))
        assert stats["rows_lost"] == lost, (stats["rows_lost"], lost)
        want_discarded = {k: n for k, n in (("unit_lost", lost), ("tail", tail)) if n}
        assert task["discarded"] == want_discarded, (task["discarded"], want_discarded)
        assert task["acked"] == self.count("acked"), (task["acked"], self.count("acked"))
        assert stats["lost_writes_skipped"] == self.told, \
            (stats["lost_writes_skipped"], self.told)
