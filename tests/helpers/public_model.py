"""The model of tests/api/test_model_public_api.py: what a user of tq_stream's public API
may rely on (README "Delivery rules", the docstrings of ``Client``,
``StreamingDataset``, ``StreamingDataLoader``, ``StalenessSampler``), as plain
bookkeeping that calls nothing in tq_stream.

One partition with two declared consumers:

- ``stage``: a pool of low-level clients (``get_meta`` without a step, ``consumer=``
  names), ``dp_size`` 1, the default sampler; in a pipeline it writes ``r``;
- ``train``: loaders of ``dp_size`` D x ``replicas`` K (one "slot" per (dp_rank,
  replica)), the default sampler or a StalenessSampler (then D = K = 1), reading
  ``x`` (and ``r`` in a pipeline).

Time matters only for leases: a dropped client's heartbeat stops, and its claims end
within ``LEASE`` (+ ``SLACK``) of the drop; before that the model does not know.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

LEASE = 1.0  # tq.init(lease_timeout=...) of the machine: a live heartbeat (every LEASE / 4)
# late by a whole LEASE on a loaded 2-core machine made a live lease lapse at 0.5
SLACK = 0.3  # heartbeat period (LEASE / 4) and scheduling, beyond which a lease is over

Slot = tuple[int, int]  # (dp_rank, replica) of the train task


@dataclass(eq=False)
class Session:
    """A consumer session as the model sees it: live until dropped or cancelled."""

    name: str = ""  # the consumer name (stage clients)
    dead_at: float | None = None  # monotonic time its client was dropped
    cancelled: bool = False

    @property
    def live(self) -> bool:
        return self.dead_at is None and not self.cancelled

    def gone(self, now: float) -> bool:
        """Its claims are certainly over (cancelled, or its lease ran out)."""
        return self.cancelled or (self.dead_at is not None and now > self.dead_at + LEASE
                                  + SLACK)

    def dying(self, now: float) -> bool:
        """Dropped, and its lease may still run: its claims may or may not hold."""
        return not self.live and not self.gone(now)


@dataclass(eq=False)
class Row:
    key: str
    value: float  # x
    version: int
    ready: int | None = None  # when it became ready for train (its place in that order)
    has_r: bool = False
    stage_acked: bool = False
    train_acks: set[int] = field(default_factory=set)  # replicas of its rank that acked
    train_step: int | None = None  # the train step it was seen in


@dataclass(frozen=True)
class TrainSpec:
    dp_size: int
    replicas: int
    batch_size: int
    max_staleness: int | None  # None: SequentialSampler
    drop_last: bool
    pipeline: bool  # train also reads "r", which the stage writes

    @property
    def fields(self) -> list[str]:
        return ["x", "r"] if self.pipeline else ["x"]

    @property
    def slots(self) -> list[Slot]:
        return [(r, k) for r in range(self.dp_size) for k in range(self.replicas)]


class Model:
    """Expected state; every ``check_*`` raises AssertionError naming the broken rule."""

    def __init__(self, spec: TrainSpec, stage_batch: int) -> None:
        self.spec = spec
        self.stage_batch = stage_batch
        self.rows: dict[str, Row] = {}
        self.ready_order: list[str] = []  # train readiness order
        self.closed = False
        # train
        self.shares: dict[tuple[int, int], tuple[str, ...]] = {}  # (step, rank) -> keys
        self.acked_steps: dict[Slot, set[int]] = {s: set() for s in spec.slots}
        self.holder: dict[tuple[int, int, int], Session | None] = {}  # (step, r, k)
        self.version: int | None = None
        self.versions_set: list[int] = []
        self.reforms = 0  # shares seen formed again at their turn (stale rows replaced)
        # stage
        self.stage_shares: dict[int, tuple[str, ...]] = {}
        self.stage_holder: dict[int, Session | None] = {}
        self.stage_done: set[int] = set()

    # ------------------------------------------------------------------ rows
    def put(self, keys: list[str], values: list[float], version: int) -> None:
        for k, v in zip(keys, values, strict=True):
            self.rows[k] = Row(k, v, version)
            if not self.spec.pipeline:
                self._ready(k)

    def _ready(self, key: str) -> None:
        row = self.rows[key]
        if row.ready is None:
            row.ready = len(self.ready_order)
            self.ready_order.append(key)

    def wrote_r(self, keys: tuple[str, ...]) -> None:
        for k in keys:
            self.rows[k].has_r = True
            if self.spec.pipeline:
                self._ready(k)

    def all_ready(self) -> bool:
        return len(self.ready_order) == len(self.rows)

    # ------------------------------------------------------------------ train
    def train_done(self, row: Row) -> bool:
        return len(row.train_acks) == self.spec.replicas

    def next_step(self, slot: Slot) -> int:
        done = self.acked_steps[slot]
        s = 0
        while s in done:
            s += 1
        return s

    def stale(self, row: Row) -> bool:
        """Stale against the version the trainer set last (versions only grow)."""
        s = self.spec.max_staleness
        return s is not None and self.version is not None and row.version < self.version - s

    def _observed_rows(self) -> set[str]:
        return {k for keys in self.shares.values() for k in keys}

    def formable(self, step: int) -> bool:
        """Step ``step`` of train exists or can be formed now (for every rank), with
        rows (a step formed again at its turn with no row left is skipped)."""
        spec = self.spec
        per_step = spec.batch_size * spec.dp_size
        if spec.max_staleness is None:
            if any(s >= step for s, _ in self.shares):
                return True
            n = len(self.ready_order)
            if n >= (step + 1) * per_step:
                return True
            full, left = divmod(n, per_step)
            return (self.closed and self.all_ready() and not spec.drop_last
                    and step == full and left >= spec.dp_size)
        # D = K = 1. Rows not in a share the model saw and not stale ("fresh") form
        # every step it has not seen up to ``step`` (steps formed ahead by a prefetch
        # hold such rows, or are formed again from them at their turn); a share it saw
        # whose rows went stale is formed again from its rows still in bound and fresh
        # ones (controller/turns.py).
        fresh = self._fresh()
        slot = (0, 0)
        unseen = [s for s in range(self.next_step(slot), step + 1)
                  if s not in self.acked_steps[slot] and (s, 0) not in self.shares]
        known = self.shares.get((step, 0))
        if known is not None and self.reformed(known):
            fresh += sum(not self.stale(self.rows[k]) for k in known)
            unseen.append(step)
        drained = self.closed and self.all_ready() and not spec.drop_last
        need = len(unseen) * spec.batch_size
        return fresh >= need or (drained and fresh > need - spec.batch_size)

    def reformed(self, keys: tuple[str, ...]) -> bool:
        """A share the model saw is formed again at its next hand-out: no replica acked
        a row of it, and some row is stale against the version set last."""
        rows = [self.rows[k] for k in keys]
        return not any(r.train_acks for r in rows) and any(self.stale(r) for r in rows)

    def live_holder(self, step: int, slot: Slot, me: Session | None) -> Session | None:
        h = self.holder.get((step, *slot))
        return h if h is not None and h is not me and h.live else None

    def available(self, slot: Slot, step: int | None = None) -> bool:
        """A batch for ``slot`` comes within a wait (a dying holder's lease runs out
        within it)."""
        asked = step is not None
        step = self.next_step(slot) if step is None else step
        if self.formable(step):
            return self.live_holder(step, slot, None) is None
        if asked or self.spec.max_staleness is None or self._fresh() or not (
                self.closed and self.all_ready()):
            return False
        # drained, every unseen row stale: the steps before the next share the model saw
        # with rows in the bound are formed again with no row left, and skipped
        later = sorted(s for s, r in self.shares if s > step and r == slot[0]
                       and s not in self.acked_steps[slot]
                       and not all(self.stale(self.rows[k]) for k in self.shares[(s, r)]))
        return bool(later) and self.live_holder(later[0], slot, None) is None

    def _fresh(self) -> int:
        """Ready rows in no share the model saw, within the bound."""
        seen = self._observed_rows()
        return sum(k not in seen and not self.stale(self.rows[k]) for k in self.ready_order)

    def tail_rows(self) -> int:
        """Rows of a closed, complete partition the sequential sampler discards."""
        spec = self.spec
        per_step = spec.batch_size * spec.dp_size
        full, left = divmod(len(self.ready_order), per_step)
        return left if (spec.drop_last or left < spec.dp_size) else 0

    def train_end(self) -> bool:
        """Every rank and replica gets the end at its next ask."""
        if not (self.closed and self.all_ready()):
            return False
        undone = [r for r in self.rows.values() if not self.train_done(r)]
        if self.spec.max_staleness is None:
            return len(undone) == self.tail_rows() and all(r.train_step is None
                                                            for r in undone)
        return all(self.stale(r) and (r.train_step is None or self.in_reformable(r))
                   for r in undone)

    def in_reformable(self, row: Row) -> bool:
        """``row`` is in a share the model saw that is formed again at its next
        hand-out (its stale rows are then discarded)."""
        keys = None if row.train_step is None else self.shares.get((row.train_step, 0))
        return keys is not None and self.reformed(keys)

    def skip_emptied(self, slot: Slot, upto: int) -> None:
        """The loader went on to step ``upto``: the steps before it that ``slot`` has
        not acked were formed again with no row left (every row stale, none to replace
        them on a drained partition), and are skipped."""
        assert self.spec.max_staleness is not None and self.closed and self.all_ready(), \
            f"slot {slot} skipped to step {upto} from {self.next_step(slot)}"
        for s in range(self.next_step(slot), upto):
            if s in self.acked_steps[slot]:
                continue
            keys = self.shares.pop((s, slot[0]), ())
            rows = [self.rows[k] for k in keys]
            assert all(self.stale(r) and not r.train_acks for r in rows), \
                f"slot {slot} skipped step {s}, whose share {keys} has rows in the bound"
            for r in rows:
                r.train_step = None
            self.acked_steps[slot].add(s)

    def deliver_train(self, slot: Slot, step: int, rank: int, replica: int,
                      keys: tuple[str, ...], to: Session | None) -> None:
        """A train batch reached a consumer of ``slot`` (a loader's yield, or a read by
        number): check the delivery rules and the staleness bound at the version the
        trainer set last."""
        assert (rank, replica) == slot, f"slot {slot} got a batch of {(rank, replica)}"
        assert keys, f"slot {slot} got an empty batch at step {step}"
        unknown = [k for k in keys if k not in self.rows]
        assert not unknown, f"rows never written delivered: {unknown}"
        again = [k for k in keys if replica in self.rows[k].train_acks]
        assert not again, (f"exactly once: rows acked by train rank {rank} replica "
                           f"{replica} delivered to it again at step {step}: {again}")
        known = self.shares.get((step, rank))
        if known is not None and keys != known:
            assert self.reformed(known), (f"the share of step {step} rank {rank} changed: "
                                          f"{known} -> {keys}")
            for k in known:  # formed again: its stale rows discarded, the rest back
                self.rows[k].train_step = None
            del self.shares[(step, rank)]
            self.reforms += 1
            known = None
        if known is not None:
            assert keys == known, (f"the share of step {step} rank {rank} changed: "
                                   f"{known} -> {keys}")
        else:
            elsewhere = set(keys) & self._observed_rows()
            assert not elsewhere, f"rows in two shares of train: {sorted(elsewhere)}"
            self._check_formed(step, rank, keys)
            self.shares[(step, rank)] = keys
            for k in keys:
                self.rows[k].train_step = step
        other = self.live_holder(step, slot, to)
        assert other is None, (f"step {step} of train slot {slot} is held by a live "
                               f"session and was handed to another")
        self.holder[(step, *slot)] = to
        self._check_bound(step, keys)

    def _check_formed(self, step: int, rank: int, keys: tuple[str, ...]) -> None:
        not_ready = [k for k in keys if self.rows[k].ready is None]
        assert not not_ready, f"train got rows that lack its fields: {not_ready}"
        spec = self.spec
        if spec.max_staleness is None:  # oldest ready first, contiguous shares
            per_step, b = spec.batch_size * spec.dp_size, spec.batch_size
            start = step * per_step
            if len(self.ready_order) >= start + per_step or not self.closed:
                want = tuple(self.ready_order[start + rank * b:start + (rank + 1) * b])
                assert keys == want, (f"SequentialSampler must hand out the oldest ready "
                                      f"rows: step {step} rank {rank} got {keys}, "
                                      f"expected {want}")

    def _check_bound(self, step: int, keys: tuple[str, ...]) -> None:
        s, v = self.spec.max_staleness, self.version
        if s is None or v is None:
            return
        old = [(k, self.rows[k].version) for k in keys if self.rows[k].version < v - s]
        assert not old, (f"staleness bound broken at yield: version {v}, max_staleness "
                         f"{s}, step {step} has rows {old}")

    def train_acked(self, slot: Slot, step: int) -> int:
        """``slot`` acked its share of ``step``; returns the rows now acked by every
        replica (what ``Client.ack`` returns)."""
        rank, replica = slot
        keys = self.shares[(step, rank)]
        newly = 0
        if step not in self.acked_steps[slot]:
            self.acked_steps[slot].add(step)
            for k in keys:
                row = self.rows[k]
                row.train_acks.add(replica)
                newly += self.train_done(row)
        self.holder.pop((step, *slot), None)
        return newly

    def can_go_on(self, slot: Slot, step: int) -> bool:
        """Once ``slot`` acked ``step``, its next ask gets a batch or the end."""
        rank, replica = slot
        added = [k for k in self.shares[(step, rank)]
                 if replica not in self.rows[k].train_acks]
        fresh = step not in self.acked_steps[slot]
        self.acked_steps[slot].add(step)
        for k in added:
            self.rows[k].train_acks.add(replica)
        try:
            return self.available(slot) or self.train_end()
        finally:
            for k in added:
                self.rows[k].train_acks.discard(replica)
            if fresh:
                self.acked_steps[slot].discard(step)

    def give_back(self, slot: Slot, step: int) -> None:
        self.holder[(step, *slot)] = None

    def set_version(self, version: int) -> None:
        self.version = version
        self.versions_set.append(version)

    # ------------------------------------------------------------------ stage
    def stage_unformed(self) -> list[str]:
        seen = {k for keys in self.stage_shares.values() for k in keys}
        return [k for k in self.rows if k not in seen]

    def _stage_open(self) -> list[int]:
        return [s for s in self.stage_shares if s not in self.stage_done]

    def stage_choices(self, me: Session, now: float) -> tuple[set[int], set[int], bool]:
        """(shares ``me`` must get first, shares it may get, a new step is certain)."""
        own, free, maybe = set(), set(), set()
        for s in self._stage_open():
            h = self.stage_holder[s]
            if h is None:
                free.add(s)
            elif h.gone(now):
                (own if me.name and h.name == me.name else free).add(s)
            elif h.dying(now):
                maybe.add(s)
        unformed = len(self.stage_unformed())
        new = unformed >= self.stage_batch or (self.closed and unformed > 0)
        if own:
            return own, own | maybe, True
        if free:
            return free, free | maybe, True
        return set(), maybe, new

    def stage_end(self, me: Session) -> bool:
        """``me`` gets the end at its next ask."""
        return (self.closed and not self.stage_unformed()
                and all(self.stage_holder[s] is me for s in self._stage_open()))

    def deliver_stage(self, me: Session, step: int, keys: tuple[str, ...],
                      now: float) -> None:
        must, may, _new = self.stage_choices(me, now)
        assert keys, f"stage got an empty batch at step {step}"
        if step in self.stage_shares:
            assert keys == self.stage_shares[step], (
                f"the share of stage step {step} changed: {self.stage_shares[step]} -> {keys}")
            h = self.stage_holder[step]
            assert h is not me, f"stage step {step} handed twice to the session holding it"
            assert h is None or not h.live, (
                f"no live-session share to another: stage step {step} held by a live "
                f"session (consumer {h.name!r}) went to consumer {me.name!r}")
            assert step in may, (f"stage step {step} was handed out while {sorted(must)} "
                                 f"come first (own dead predecessor's, then unclaimed)")
        else:
            assert not must, (f"stage formed step {step} while shares {sorted(must)} "
                              f"were free for consumer {me.name!r}")
            assert step == len(self.stage_shares), (f"stage step {step} formed out of "
                                                    f"order")
            unformed = self.stage_unformed()
            want = set(unformed[:self.stage_batch])
            assert set(keys) == want, (f"SequentialSampler must hand out the oldest rows: "
                                       f"stage got {keys}, expected {sorted(want)}")
            self.stage_shares[step] = keys
        done = [k for k in keys if self.rows[k].stage_acked]
        assert not done, f"exactly once: rows acked by stage delivered again: {done}"
        self.stage_holder[step] = me

    def stage_acked(self, step: int) -> int:
        self.stage_done.add(step)
        self.stage_holder[step] = None
        for k in self.stage_shares[step]:
            self.rows[k].stage_acked = True
        return len(self.stage_shares[step])

    # ------------------------------------------------------------------ freeing
    def freeable(self, row: Row) -> tuple[bool, bool]:
        """(certainly freed, possibly freed)."""
        if not row.stage_acked:
            return False, False
        if self.train_done(row):
            return True, True
        maybe_discarded = (row.train_step is None or self.in_reformable(row)) and \
            (self.stale(row) or self.closed)
        return False, maybe_discarded

    def check_stored(self, listed: dict[str, list[str]]) -> None:
        """``listed``: key -> fields of every row ``kv.list`` shows."""
        for row in self.rows.values():
            gone, maybe = self.freeable(row)
            if not maybe:
                assert row.key in listed, (
                    f"nothing freed early: row {row.key} was freed although "
                    f"stage acked={row.stage_acked}, train acks={sorted(row.train_acks)} "
                    f"of {self.spec.replicas} replicas")
            if gone:
                assert row.key not in listed, (
                    f"row {row.key} was acked by every declared consumer and never freed")
            if row.key in listed and row.has_r:
                assert "r" in listed[row.key], f"row {row.key} lost its field r"
        extra = set(listed) - set(self.rows)
        assert not extra, f"rows stored that were never written: {sorted(extra)}"

    def check_counts(self, tasks: dict) -> None:
        train = sum(self.train_done(r) for r in self.rows.values())
        assert tasks["train"]["acked"] == train, (tasks["train"]["acked"], train)
        stage = sum(r.stage_acked for r in self.rows.values())
        assert tasks["stage"]["acked"] == stage, (tasks["stage"]["acked"], stage)

    # ------------------------------------------------------------------ the end
    def check_accounted(self, tasks: dict, rows_left: int) -> None:
        """After the close and the drain: every row acked, or discarded with a reason
        that holds for it."""
        assert all(r.stage_acked for r in self.rows.values()), "stage left rows unacked"
        undone = [r for r in self.rows.values() if not self.train_done(r)]
        discarded = dict(tasks["train"]["discarded"])
        assert sum(discarded.values()) == len(undone), (discarded, [r.key for r in undone])
        if self.spec.max_staleness is None:
            assert set(discarded) <= {"tail"}, discarded
            assert len(undone) == self.tail_rows(), (len(undone), self.tail_rows())
        else:
            assert set(discarded) <= {"stale"}, discarded
            vmax = max(self.versions_set, default=None)
            s = self.spec.max_staleness
            fresh = [(r.key, r.version) for r in undone
                     if vmax is None or r.version >= vmax - s]
            assert not fresh, (f"rows discarded although never stale against a version "
                               f"set (max {vmax}, max_staleness {s}): {fresh}")
        assert tasks["stage"]["discarded"] == {}, tasks["stage"]["discarded"]
        assert rows_left == 0, f"{rows_left} rows never freed"


def now() -> float:
    return time.monotonic()
