"""Random interleavings of puts, gets, acks, releases, lease expiries, consumer deaths
and replacements, a task that registers late and tags that arrive after the fields, on
the embedded controller and client, checking the delivery guarantees (docs/design.md):

- a row is never handed to a task again once that task acked it, and when the
  consumers keep going every written row is acked (or discarded, counted);
- replicas of one DP rank see identical rows; DP ranks of a step get disjoint rows;
- every rank gets the same number of batches; GroupSampler groups stay whole;
- when everything is consumed, storage and controller rows are back to zero.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import tq_stream as tq
from tests.conftest import FakeClock
from tq_stream.controller import Controller
from tq_stream.errors import LeaseError, WaitTimeout

P = "p"
LEASE = 10.0
TINY = 1e-3


@dataclass
class Consumer:
    task: str
    rank: int
    replica: int
    step: int = 0
    held: tq.BatchMeta | None = None
    ended_at: int | None = None
    skip: set[int] = field(default_factory=set)


@dataclass
class TaskModel:
    name: str
    fields: list[str]
    batch_size: int
    dp_size: int
    replicas: int
    group_size: int | None
    acked: set[str] = field(default_factory=set)
    share: dict[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)
    acks: dict[tuple[int, int], set[int]] = field(default_factory=dict)  # replicas done


class DeliveryMachine(RuleBasedStateMachine):
    """One partition, a main task with drawn settings and an auxiliary task."""

    @initialize(dp_size=st.integers(1, 2), replicas=st.integers(1, 2),
                groups=st.sampled_from([None, 1, 2]), per_rank=st.integers(1, 2),
                two_fields=st.booleans(), drop_last=st.booleans(), backwards=st.booleans())
    def setup(self, dp_size, replicas, groups, per_rank, two_fields, drop_last, backwards):
        self.clock = FakeClock()
        self.stream = tq.init(config=tq.StreamConfig(timeout=5.0))
        ctrl = self.stream.connection.controller()
        if isinstance(ctrl, Controller):  # embedded (a local controller keeps real time)
            ctrl.set_clock(self.clock.time)
        self.stream.create_partition(P, consumers=["main", "aux"])
        self.client = self.stream.client()
        self.group_size = groups
        g = groups or 1
        main = TaskModel("main", ["a", "b"] if two_fields else ["a"], per_rank * g, dp_size,
                         replicas, groups)
        aux = TaskModel("aux", ["a"], 2, 1, 1, None)
        self.tasks = {t.name: t for t in (main, aux)}
        self.drop_last = drop_last
        self.backwards = backwards
        self.consumers: list[Consumer] = []
        self.registered: set[str] = set()
        self._register(main)  # aux registers late (a rule), or at the drain
        self.written: list[str] = []
        self.without_b: list[str] = []
        self.untagged: list[tuple[str, dict]] = []  # rows whose group tags come later
        self.n_groups = 0
        self.done = False

    def _register(self, t: TaskModel) -> None:
        sampler = tq.samplers.GroupSampler(group_size=t.group_size) if t.group_size \
            else None
        self.client.register_task(P, t.name, t.fields, t.batch_size, dp_size=t.dp_size,
                                  replicas=t.replicas, lease_timeout=LEASE,
                                  drop_last=self.drop_last and t.name == "main",
                                  sampler=sampler)
        self.registered.add(t.name)
        self.consumers += [Consumer(t.name, r, k) for r in range(t.dp_size)
                           for k in range(t.replicas)]
        # the order in which the drain serves consumers (rank 0 first, or the last rank)
        self.drain_order = self.consumers[::-1] if self.backwards else list(self.consumers)

    def teardown(self):
        if hasattr(self, "stream"):
            try:
                if not self.done:
                    self.drain()
            finally:
                self.stream.close()

    # ------------------------------------------------------------------ writes
    @precondition(lambda self: not self.done)
    @rule(groups=st.integers(1, 3), with_b=st.booleans(), late_tags=st.booleans())
    def put(self, groups, with_b, late_tags):
        g = self.group_size or 1
        keys, tags = [], []
        for _ in range(groups):
            uid = f"u{self.n_groups}"
            self.n_groups += 1
            keys += [f"{uid}_{i}" for i in range(g)]
            tags += [{"uid": uid, "version": self.n_groups}] * g
        if late_tags and self.group_size:  # the group sampler must wait for "uid"
            self.untagged += list(zip(keys, tags, strict=True))
            tags = [{"version": t["version"]} for t in tags]
        data = {"a": torch.arange(len(keys), dtype=torch.float32)}
        # b comes later only when a task needs it: a late field nobody waits for could
        # reach a row that was consumed and freed, and re-create it half-written
        if with_b or "b" not in self.tasks["main"].fields:
            data["b"] = [torch.ones(i % 3 + 1) for i in range(len(keys))]
        else:
            self.without_b += keys
        self.stream.writer(P).put(keys, data, tags=tags)
        self.written += keys

    @precondition(lambda self: not self.done and self.without_b)
    @rule(data=st.data())
    def add_b(self, data):
        n = data.draw(st.integers(1, len(self.without_b)))
        keys, self.without_b = self.without_b[:n], self.without_b[n:]
        self.stream.writer(P).put(keys, {"b": [torch.ones(2)] * len(keys)})

    @precondition(lambda self: not self.done and self.untagged)
    @rule(data=st.data())
    def add_tags(self, data):
        n = data.draw(st.integers(1, len(self.untagged)))
        todo, self.untagged = self.untagged[:n], self.untagged[n:]
        self.stream.set_tags(P, [k for k, _ in todo], [t for _, t in todo])

    @precondition(lambda self: not self.done and "aux" not in self.registered)
    @rule()
    def register_late(self):
        """aux registers after main acked rows: none of them may be lost to it."""
        self._register(self.tasks["aux"])

    # ---------------------------------------------------------------- consumers
    @precondition(lambda self: not self.done)
    @rule(data=st.data())
    def fetch(self, data):
        c = data.draw(st.sampled_from(self.consumers))
        if c.held is None and c.ended_at is None:
            self._fetch(c)

    @precondition(lambda self: not self.done)
    @rule(data=st.data())
    def ack(self, data):
        c = data.draw(st.sampled_from(self.consumers))
        if c.held is not None:
            self._ack(c)

    @precondition(lambda self: not self.done)
    @rule(data=st.data())
    def release(self, data):
        c = data.draw(st.sampled_from(self.consumers))
        if c.held is not None:
            self.client.release(c.held)
            c.held = None

    @precondition(lambda self: not self.done)
    @rule()
    def expire_leases(self):
        """Time passes with no heartbeat: every claim expires, no share changes."""
        self.clock.advance(LEASE + 1)

    @precondition(lambda self: not self.done)
    @rule(data=st.data())
    def replace_consumer(self, data):
        """A consumer dies holding a batch; a fresh one for its rank and replica resumes
        from the controller's first step that replica has not acked (no step
        bookkeeping of its own), as a loader does. (Resuming at the rank's first step
        not acked by *every* replica would read again a step this replica acked.)"""
        c = data.draw(st.sampled_from(self.consumers))
        if c.ended_at is not None:
            return
        where = self.client.first_unfinished(P, c.task, c.rank, c.replica)
        c.held, c.step, c.skip = None, where["step"], set(where["skip"])
        while c.step in c.skip:
            c.step += 1

    @precondition(lambda self: not self.done)
    @rule()
    def drain_now(self):
        self.drain()

    @precondition(lambda self: self.done)
    @rule()
    def after_the_end(self):
        """Nothing is left to do once drained (a rule so the machine can go on)."""

    # -------------------------------------------------------------- invariants
    @invariant()
    def shares_of_a_step_are_disjoint(self):
        if not hasattr(self, "tasks"):
            return
        for t in self.tasks.values():
            by_step: dict[int, list[set[str]]] = {}
            for (step, _), keys in t.share.items():
                by_step.setdefault(step, []).append(set(keys))
            for step, shares in by_step.items():
                union = set().union(*shares)
                assert len(union) == sum(map(len, shares)), (t.name, step, shares)

    # ----------------------------------------------------------------- helpers
    def _fetch(self, c: Consumer) -> None:
        t = self.tasks[c.task]
        try:
            meta = self.client.get_meta(P, c.task, c.step, c.rank, timeout=TINY,
                                        replica=c.replica)
        except WaitTimeout:
            return
        if meta.end:
            c.ended_at = meta.step
            return
        keys = meta.keys
        assert meta.step == c.step and meta.dp_rank == c.rank
        assert 1 <= len(keys) <= t.batch_size, (len(keys), t.batch_size)
        assert not set(keys) & t.acked, f"{c.task} got acked rows again: {set(keys) & t.acked}"
        known = t.share.get((c.step, c.rank))
        if known is not None:  # replicas, readers after a release, expiry or death
            assert keys == known, f"share of rank {c.rank} changed at step {c.step}"
        t.share[(c.step, c.rank)] = keys
        if t.group_size:
            sizes = Counter(tag["uid"] for tag in meta.tags)
            assert set(sizes.values()) == {t.group_size}, f"a group was split: {sizes}"
        if "b" in t.fields:
            assert not set(keys) & set(self.without_b), "a row without b was handed out"
        c.held = meta

    def _ack(self, c: Consumer) -> None:
        t = self.tasks[c.task]
        meta = c.held
        try:
            self.client.ack(meta)  # an expired claim does not matter: the share is fixed
        except LeaseError:
            # only a share every replica acked is gone (a replaced replica acked it again)
            assert t.acks.get((c.step, c.rank), set()) >= set(range(t.replicas)), c
        done = t.acks.setdefault((c.step, c.rank), set())
        done.add(c.replica)
        if len(done) == t.replicas:  # acked once every replica acked
            t.acked |= set(meta.keys)
        c.held = None
        c.step += 1
        while c.step in c.skip:
            c.step += 1

    def drain(self) -> None:
        """Close the partition, complete every row, consume to the end; check it all."""
        self.done = True
        if "aux" not in self.registered:
            self._register(self.tasks["aux"])
        if self.untagged:
            self.stream.set_tags(P, [k for k, _ in self.untagged],
                                 [t for _, t in self.untagged])
            self.untagged = []
        if self.without_b:
            self.stream.writer(P).put(self.without_b, {"b": [torch.ones(1)] * len(
                self.without_b)})
            self.without_b = []
        self.stream.close_partition(P)
        for _ in range(2000):
            if all(c.ended_at is not None for c in self.consumers):
                break
            for c in self.drain_order:
                if c.held is not None:
                    self._ack(c)
                elif c.ended_at is None:
                    self._fetch(c)
        else:
            raise AssertionError(f"consumers never reached the end: {self.consumers}")
        stats = self.stream.stats()[P]
        for t in self.tasks.values():
            ends = {c.ended_at for c in self.consumers if c.task == t.name}
            assert len(ends) == 1, f"ranks saw different ends: " \
                f"{[(c.rank, c.replica, c.step, c.ended_at) for c in self.consumers]}"
            ts = stats["tasks"][t.name]
            discarded = sum(ts["discarded"].values())
            assert set(ts["discarded"]) <= {"tail"}, ts["discarded"]
            assert ts["acked"] == len(t.acked)
            assert len(t.acked) + discarded == len(self.written), (t.name, ts)
            assert discarded < t.batch_size * t.dp_size
            assert t.acked <= set(self.written)
        assert stats["rows"] == 0
        assert sum(u.nbytes() for u in self.stream.connection.units()) == 0


DeliveryMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestDelivery = DeliveryMachine.TestCase
