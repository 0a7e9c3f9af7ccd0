"""A model-based test of units lost between two puts of a row (issue 20, item 7 and
"Proof"), local mode with 2 storage units.

A hypothesis state machine plays a producer that writes each row in two puts (``x``,
then ``r``), the DP ranks of task ``t`` reading steps by number (``get_meta``, ``ack``,
lockstep control), storage units SIGKILLed by their pid (``stream.processes()``) at
any point (then: nothing, a put of ``x`` or of ``r`` at once, ``restart_unit`` at
once or while a put of ``r`` is retried) and restarted by hand
(``stream.owner.restart_unit``, README "Failures"); the partition is closed and
drained by a ``StreamingDataLoader`` per rank. ``unit_loss_model.Model`` says what
each row is. After every step:

- nothing is freed early and no row is made again half: ``kv.list`` holds exactly the
  rows written, not acked and not lost, with their fields;
- every lost row is counted once (``rows_lost``, the task's ``unit_lost`` discards),
  and once per put that named it in ``lost_writes_skipped`` (not once per try of a
  put made again); rows a put placed on a dying unit and made again are not lost;
- a put of ``r`` returns exactly the keys of its rows lost with their unit;
- a batch holds only rows whose both fields are written, never one delivered before;
  a rank whose whole share was lost gets an empty batch, never a LeaseError;
- ``stream.processes()`` names the live process of every unit (also after a restart).

At the end every row is acked exactly once or lost, and the closed partition ends for
every rank (no WaitTimeout).

One deployment serves every example (a start costs ~2 s); each example has its own
partition and leaves every unit alive and no row behind. Its units keep no shared
memory, as on several hosts: every put goes through a unit's process, so a put placed
on a dead unit fails and is made again (a same-host put writes a dead unit's segment
and succeeds; those rows are then lost with it, which the model allows too).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import tq_stream as tq
from tests.helpers.fault_kit import alive, check_no_leftovers, faulty_local, kill, wait_until
from tests.helpers.unit_loss_model import FIELDS, Model
from tq_stream.errors import WaitTimeout

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
UNIT_TIMEOUT = 0.4  # seconds the controller waits for a silent unit
TINY = 0.05  # a get_meta that may find nothing
WAIT = 10.0  # a batch or the end that must come, comes within this
LOST_WAIT = 10.0  # the controller declares a dead unit lost within this
MAX_KILLS = 2  # per example (each costs ~UNIT_TIMEOUT or a restart)
STREAM: list[tq.Stream] = []  # the deployment of this module
PARTITIONS = itertools.count()


@pytest.fixture(scope="module", autouse=True)
def deployment() -> Iterator[None]:
    stream = faulty_local(unit_timeout=UNIT_TIMEOUT, storage="memory")
    pids = [p.pid for p in stream.processes()]
    STREAM.append(stream)
    try:
        yield
    finally:
        STREAM.clear()
        check_no_leftovers(stream, pids + [p.pid for p in stream.processes()])


def _x(keys: list[str]) -> torch.Tensor:
    return torch.tensor([float(k[1:]) for k in keys])


class UnitLossMachine(RuleBasedStateMachine):
    """See the module docstring."""

    @initialize(dp_size=st.integers(1, 2), batch_size=st.integers(1, 3),
                rows=st.integers(2, 8))
    def setup(self, dp_size, batch_size, rows):
        self.stream = STREAM[0]
        self.p = f"p{next(PARTITIONS)}"
        self.dp_size, self.batch_size = dp_size, batch_size
        self.stream.create_partition(self.p, consumers=["t"])
        self.stream.client().register_task(self.p, "t", list(FIELDS), batch_size,
                                           dp_size=dp_size)
        self.model = Model(dp_size)
        self.writer = self.stream.writer(self.p)
        self.readers = [self.stream.client() for _ in range(dp_size)]
        self.held: list[tq.BatchMeta | None] = [None] * dp_size
        self.seq = 0
        self.kills = 0
        self.done = False
        self.seen: set[str] = set()
        self.put_x(rows)

    def live(self) -> bool:
        return hasattr(self, "model") and not self.done

    def teardown(self):
        if not hasattr(self, "model"):
            return
        try:
            if not self.done:
                self.drain()
        finally:
            for u in sorted(self.model.dead):  # the next example starts with both units
                self.stream.owner.restart_unit(u)
            for what in sorted(self.seen):
                event(what)

    # ---------------------------------------------------------------- producer
    def _new_keys(self, n: int) -> list[str]:
        keys = [f"k{self.seq + i}" for i in range(n)]
        self.seq += n
        return keys

    @precondition(lambda self: self.live() and not self.model.closed)
    @rule(n=st.integers(1, 6))
    def put_x(self, n):
        keys = self._new_keys(n)
        assert self.writer.put(keys, {"x": _x(keys)}) == []
        units = self.stream.kv.meta(keys, partition=self.p).unit.tolist()
        self.model.put_x(keys, units)

    def _r_keys(self, data: st.DataObject) -> list[str]:
        """Some rows that lack r (lost ones too). Drawn over every row: which rows lack
        r depends on where the controller placed them, state this example did not
        draw (hypothesis must draw as much when it replays the example)."""
        rows = list(self.model.rows)
        pick = data.draw(st.lists(st.booleans(), min_size=len(rows), max_size=len(rows)))
        todo = set(self.model.missing_r())
        return [k for k, m in zip(rows, pick, strict=True) if m and k in todo]

    @precondition(lambda self: self.live() and self.model.rows)
    @rule(data=st.data())
    def put_r(self, data):
        self._put_r(self._r_keys(data))

    def _put_r(self, keys: list[str]) -> None:
        if not keys:
            return
        skipped = self.writer.put(keys, {"r": 2 * _x(keys)})
        want = self.model.put_r(keys)
        assert sorted(skipped) == sorted(want), (skipped, sorted(want))
        if want:
            self.seen.add("a put of r skipped rows lost with their unit")

    @precondition(lambda self: self.live() and not self.model.closed)
    @rule()
    def close(self):
        self.stream.close_partition(self.p)
        self.model.closed = True

    # ---------------------------------------------------------------- units
    def _unit_pid(self, unit: int) -> int:
        procs = [p for p in self.stream.processes() if p.role == "unit"]
        return procs[unit].pid

    @precondition(lambda self: self.live() and not self.model.dead
                  and self.kills < MAX_KILLS)
    @rule(unit=st.integers(0, 1), data=st.data(),
          then=st.sampled_from(["nothing", "put_x", "put_r", "restart", "restart_in_put"]))
    def kill_unit(self, unit, data, then):
        """SIGKILL a unit; then, at once, maybe a put or its restart."""
        pid = self._kill(unit, then)
        if then == "put_x" and not self.model.closed:
            self.put_x(data.draw(st.integers(1, 6)))
        elif then == "put_r":
            self._put_r(self._r_keys(data))
        elif then == "restart":
            self.restart_unit(unit, pid)
        elif then == "restart_in_put":
            keys = self._r_keys(data)
            errors: list[BaseException] = []

            def put() -> None:
                try:
                    self._put_r(keys)
                except BaseException as exc:  # noqa: BLE001 — reported below
                    errors.append(exc)

            t = threading.Thread(target=put)
            t.start()
            self.restart_unit(unit, pid)
            t.join(WAIT)
            assert not t.is_alive(), "a put of r never returned"
            assert errors == [], errors
        self._declared()

    def _kill(self, unit: int, then: str) -> int:
        self.kills += 1
        pid = self._unit_pid(unit)
        kill(pid)
        lost = self.model.kill(unit)
        self.seen.add(f"killed a unit holding {'no' if not lost else 'some'} rows, then "
                      f"{then}")
        return pid

    def _declared(self) -> None:
        """Wait until the controller declared the killed units lost (and their rows):
        the steps after a kill then meet a known state, whatever the machine's load
        (how long the heartbeat took is not part of the example)."""
        want = self.model.count("lost")
        ctrl = self.stream.connection.controller()
        assert wait_until(lambda: self.stream.stats()[self.p]["rows_lost"] >= want
                          and self.model.dead <= set(ctrl.dead_units()), LOST_WAIT), \
            "the controller never declared the unit lost"

    @precondition(lambda self: self.live() and self.model.dead)
    @rule()
    def restart(self):
        unit = min(self.model.dead)
        self.restart_unit(unit, self._unit_pid(unit))

    def restart_unit(self, unit: int, old: int) -> None:
        self.stream.owner.restart_unit(unit)
        self.model.back(unit)
        pid = self._unit_pid(unit)
        assert pid != old and alive(pid), f"processes() names pid {pid} for unit {unit}"

    # ---------------------------------------------------------------- consumers
    @precondition(lambda self: self.live() and self.dp_size > 1 and not self.model.dead
                  and self.kills < MAX_KILLS)
    @rule(data=st.data())
    def read_ahead_of_a_lost_share(self, data):
        """Rows for a whole step come; a rank reads its share; a unit dies: the one none
        of its rows is on when they sit on one (the peer rank's share, placed there, may
        be lost whole), else the other than its first row's; it acks. The kill does not
        depend on where the rows were placed (the controller's state across examples,
        and the units' heartbeats), so hypothesis draws the same when it replays."""
        rank = data.draw(st.integers(0, self.dp_size - 1))
        if not self.model.closed:  # a step's rows for both ranks, in one put each
            self.put_x(self.batch_size * self.dp_size)
            self._put_r(self.model.missing_r())
        if self.held[rank] is None:
            self.read(data, ack=False, rank=rank)
        meta = self.held[rank]
        # no batch yet (a read that timed out): a unit dies all the same, so which rules
        # may come next does not depend on timing
        self._kill(0 if meta is None else 1 - self.model.rows[meta.keys[0]].unit,
                   "a peer read")
        self._declared()
        if meta is not None:
            self.ack(rank)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), ack=st.booleans())
    def read(self, data, ack, rank=None):
        """A rank reads its next step (by number); it acks it now or later."""
        if rank is None:
            rank = data.draw(st.integers(0, self.dp_size - 1))
        if self.held[rank] is not None:
            self.ack(rank)
            return
        if self.model.ended[rank]:
            return
        step = self.model.next_step[rank]
        try:
            meta = self.readers[rank].get_meta(self.p, "t", step, rank, timeout=TINY)
        except WaitTimeout:
            return
        if meta.end:
            self.model.ended[rank] = True
            assert self.model.closed
            return
        assert meta.step == step
        self.model.next_step[rank] += 1
        if not len(meta):  # every row of this share was lost with its unit
            assert self.model.count("lost"), "an empty batch while no row was lost"
            self.seen.add("a rank's whole share was lost")
            return
        self.model.deliver(meta.keys)
        got = self.readers[rank].get_data(meta)
        assert torch.equal(got["x"], _x(list(meta.keys)))
        assert torch.equal(got["r"], 2 * _x(list(meta.keys)))
        self.held[rank] = meta
        if ack:
            self.ack(rank)

    def ack(self, rank: int) -> None:
        meta = self.held[rank]
        assert meta is not None
        self.held[rank] = None
        acked = self.readers[rank].ack(meta)
        assert acked == self.model.ack(meta.keys), (acked, meta.keys)

    # ---------------------------------------------------------------- the end
    def drain(self):
        """Every row gets its r, held batches are acked, each rank's loader runs to the
        end of the closed partition."""
        self.done = True
        m = self.model
        if not m.closed:
            self.close()
        self._put_r(m.missing_r())
        for rank in range(self.dp_size):
            if self.held[rank] is not None:
                self.ack(rank)
        for rank in range(self.dp_size):
            ds = tq.StreamingDataset(self.stream, self.p, "t", list(FIELDS),
                                     self.batch_size, dp_rank=rank, dp_size=self.dp_size,
                                     timeout=WAIT)
            for batch in tq.StreamingDataLoader(ds):  # acked as the next one is asked for
                keys = list(tq.batch_meta(batch).keys)
                m.deliver(keys)
                assert torch.equal(batch["r"], 2 * _x(keys))
                m.ack(keys)
        if m.tail(self.dp_size):
            self.seen.add("rows left over at the end (tail)")
        self.rows()

    # ---------------------------------------------------------------- invariants
    @invariant()
    def rows(self):
        if hasattr(self, "model"):
            listed = {r["key"]: r["fields"] for r in self.stream.kv.list(partition=self.p)}
            self.model.check(self.stream.stats()[self.p], listed)

    @invariant()
    def unit_pids(self):
        if hasattr(self, "model"):
            for u in set(range(2)) - self.model.dead:
                assert alive(self._unit_pid(u)), f"processes() names a dead unit {u}"


UnitLossMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=16, deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestUnitLoss = UnitLossMachine.TestCase
