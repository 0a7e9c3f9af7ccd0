"""A model-based test of tq_stream's public API (issue 20, "Proof"), embedded mode.

A hypothesis state machine plays a producer, a pool of stage workers (low-level
clients, ``get_meta`` without a step, shared ``consumer=`` names) and the trainer
ranks of a DP x replicas task (``StreamingDataLoader`` loops), the way the README and
the docstrings say to use them, and checks each answer against ``public_model.Model``:

- training steps that raise inside ``for batch in loader`` (the batch comes first
  again), ``break`` (the batch is acked as the loop is left: nothing comes again),
  ``loader.release()``, loops that run off the end, an open iteration closed by hand;
- consumers that die: a stage client dropped (its heartbeat stops, its lease runs out
  after ``lease_timeout``) or cancelled, a trainer dropped in the middle of a loop, a
  reader of a step by number that dies holding it; their rows come back to the
  others, first to a worker of the same ``consumer`` name;
- two live consumers of one (task, dp_rank, replica) (the second is refused with a
  ConfigError naming ``replica``), ``replicas > 1`` without ``replica`` (refused),
  replicas 1 with and without ``replica=``;
- a StalenessSampler with the version set every N steps or never;
- steps acked out of order by number (gaps a fresh loader skips).

After every step: no row stored was freed before every declared consumer acked it,
every row acked by both is freed, the ack counters agree, the controller's claims of
live stage workers are exactly what they hold. At every delivery: no row acked by a
(task, rank, replica) comes to it again, a share held by a live session goes to no
other, a formed share never changes, the staleness bound holds, and a batch the model
says is there comes (no WaitTimeout). At the end (close, drain) every row is acked, or
discarded for a reason that holds for it, and freed.

A storage unit lost between two puts of a row cannot be simulated in embedded mode
through the public API (``restart_unit`` is local/Ray mode): see
tests/integration/faults/test_lost_between_puts.py and
tests/integration/faults/test_model_unit_loss.py.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, settings, target
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import tq_stream as tq
from tests.helpers.public_model import LEASE, SLACK, Model, Session, Slot, TrainSpec, now
from tq_stream.errors import ConfigError, WaitTimeout

P = "p"
WAIT = 3.0  # a batch the model says is there must come within this (> LEASE + SLACK)
TINY = 0.02  # a get_meta that may find nothing
DUP_WAIT = 0.25  # how long a duplicate replica waits before its ConfigError
NAMES = ["", "w0", "w1"]
MAX_WAITS = 2  # lease expiries waited for per example (each costs ~LEASE seconds)
DROPS_COLLECTED: list[tuple] = []  # drops that needed gc.collect()
HEARTBEAT_AGES: list[float] = []  # the oldest heartbeat of a live stage worker, per step


class StepFailed(Exception):
    """A training step that fails (a CUDA OOM) inside ``for batch in loader``."""


@dataclass(eq=False)
class Trainer:
    """One trainer process of a (dp_rank, replica) slot and its loader."""

    slot: Slot
    loader: tq.StreamingDataLoader
    open: Iterator | None = None  # an iteration left open across steps of the machine
    out: tq.BatchMeta | None = None  # its batch, being trained
    session: Session | None = None  # the open iteration's session


@dataclass(eq=False)
class Worker:
    """A stage worker: a low-level client of the stage task."""

    client: tq.Client
    session: Session
    held: list[tq.BatchMeta] = field(default_factory=list)


def _pick(data: st.DataObject, items: list):
    """One of ``items``, drawn by index: hypothesis keeps what it draws (to print the
    example), and a drawn client or loader would outlive its "death"."""
    return items[data.draw(st.integers(0, len(items) - 1))]


@dataclass(eq=False)
class _Box:
    client: tq.Client | None


def _drop(owner: object, *names: str) -> None:
    """Drop ``owner``'s references ``names`` (a client or loader that dies): they must
    go at once (no reference cycle keeps them); a full collection only if not."""
    refs = [weakref.ref(v) for v in (getattr(owner, n) for n in names) if v is not None]
    for n in names:
        setattr(owner, n, None)
    if any(r() is not None for r in refs):
        gc.collect()
        DROPS_COLLECTED.append(names)
    assert all(r() is None for r in refs), f"{names} outlived its owner"


def _values(keys: tuple[str, ...]) -> torch.Tensor:
    return torch.tensor([float(k[1:]) for k in keys])


class PublicAPIMachine(RuleBasedStateMachine):
    """See the module docstring."""

    @initialize(dp_size=st.integers(1, 2), replicas=st.integers(1, 2),
                batch_size=st.integers(1, 2), stage_batch=st.integers(1, 3),
                staleness=st.sampled_from([None, 0, 1]), drop_last=st.booleans(),
                pipeline=st.booleans(), every=st.sampled_from([None, 1, 2, 3]),
                first_version=st.sampled_from([None, 0, 3]), rows=st.integers(4, 12),
                worker=st.sampled_from(NAMES), warm_up=st.integers(1, 3),
                warm_exit=st.sampled_from(["break", "raise"]))
    def setup(self, dp_size, replicas, batch_size, stage_batch, staleness, drop_last,
              pipeline, every, first_version, rows, worker, warm_up, warm_exit):
        if staleness is not None:  # versions are per task: one trainer sets them
            dp_size = replicas = 1
            drop_last = False
            if every is not None and first_version is None:
                first_version = 0  # README: set_version before the first batch
        self.spec = TrainSpec(dp_size, replicas, batch_size, staleness, drop_last, pipeline)
        self.model = Model(self.spec, stage_batch)
        self.every = every if staleness is not None else None
        self.stream = tq.init(lease_timeout=LEASE, config=tq.StreamConfig(timeout=10.0))
        self.stream.create_partition(P, consumers=["train", "stage"])
        admin = self.stream.client()
        admin.register_task(P, "stage", ["x"], stage_batch)
        admin.register_task(P, "train", self.spec.fields, batch_size, dp_size=dp_size,
                            replicas=replicas, drop_last=drop_last, sampler=self._sampler())
        self.trainers: dict[Slot, Trainer | None] = {s: None for s in self.spec.slots}
        self.workers: list[Worker] = []
        self.sessions: list[Session] = []  # of clients that may die
        self.seq = 0
        self.made = 0  # trainers made: every other one with replicas=1 passes replica=0
        self.trained = 0  # batches reaching a training step
        self.trained_early = 0  # of them, before the drain
        self.leader_steps = 0
        self.leader_trained: set[int] = set()  # steps the version was counted for
        self.waits = 0
        self.done = False
        self.seen: set[str] = set()  # what this example exercised (events)
        if staleness is not None and first_version is not None:
            self._trainer((0, 0)).loader.set_version(first_version)  # before any batch
            self.model.set_version(first_version)
        self.put(rows, 0)
        self._join(worker)
        for _ in range(warm_up):  # the run starts: the stage works, a trainer trains
            self.stage_work_on(self.workers[0])
        if warm_up:
            self._train((0, 0), warm_up, warm_exit)

    def _sampler(self) -> tq.samplers.Sampler | None:
        s = self.spec.max_staleness
        return None if s is None else tq.samplers.StalenessSampler(max_staleness=s)

    def live(self) -> bool:
        return hasattr(self, "model") and not self.done

    def teardown(self):
        if not hasattr(self, "stream"):
            return
        try:
            if not self.done:
                self.drain()
        finally:
            self.trainers.clear()
            self.workers.clear()
            self.stream.close()
            if self.model.reforms:
                self.seen.add("train: a share formed again at its turn")
            for what in sorted(self.seen):
                event(what)
            event("trained before the drain" if self.trained_early else
                  "trained in the drain only" if self.trained else "never trained")
            target(float(self.trained_early), label="batches trained before the drain")

    # ---------------------------------------------------------------- producer
    @precondition(lambda self: self.live() and not self.model.closed)
    @rule(n=st.integers(1, 6), lag=st.integers(-1, 3))
    def put(self, n, lag):
        keys = tuple(f"k{self.seq + i}" for i in range(n))
        self.seq += n
        version = (self.model.version or 0) - lag
        self.stream.writer(P).put(list(keys), {"x": _values(keys)},
                                  tags=[{"version": version}] * n)
        self.model.put(list(keys), _values(keys).tolist(), version)

    @precondition(lambda self: self.live() and not self.model.closed)
    @rule(by_writer=st.booleans())
    def close(self, by_writer):
        if by_writer:
            self.stream.writer(P).close_partition()
        else:
            self.stream.close_partition(P)
        self.model.closed = True

    # ----------------------------------------------------------------- stage pool
    @precondition(lambda self: self.live() and len(self.workers) < 3)
    @rule(name=st.sampled_from(NAMES))
    def stage_join(self, name):
        """A stage worker starts (a restarted one reuses its dead predecessor's name)."""
        self._join(name)

    def _join(self, name: str) -> Worker:
        w = Worker(self.stream.client(consumer=name), Session(name))
        self.workers.append(w)
        self.sessions.append(w.session)
        return w

    @precondition(lambda self: self.live() and self.workers)
    @rule(data=st.data())
    def stage_get(self, data):
        self._stage_get(_pick(data, self.workers), TINY)

    def _stage_get(self, w: Worker, idle: float) -> tq.BatchMeta | None:
        m = self.model
        before = now()
        must, _, new = m.stage_choices(w.session, before)
        end = m.stage_end(w.session)
        certain = bool(must) or new or end
        try:
            meta = w.client.get_meta(P, "stage", timeout=WAIT if certain else idle)
        except WaitTimeout:
            assert not certain, (f"a stage batch was there and none came: must={must} "
                                 f"new={new} end={end}")
            return None
        assert meta is not None
        if meta.end:
            assert m.stage_end(w.session), "stage got the end while rows were left"
            return meta
        after = now()
        must, _, _ = m.stage_choices(w.session, before)
        _, may, _ = m.stage_choices(w.session, after)
        if meta.step in m.stage_shares:
            h = m.stage_holder[meta.step]
            if h is not None and not h.live:
                self.seen.add("stage: a dead worker's share came back")
                if h.name and h.name == w.session.name:
                    self.seen.add("stage: a restarted worker took back its share")
        m.deliver_stage(w.session, meta.step, meta.keys, before)
        assert meta.step in m.stage_shares
        assert torch.equal(w.client.get_data(meta)["x"], _values(meta.keys))
        w.held.append(meta)
        del must, may
        return meta

    @precondition(lambda self: self.live() and self.workers)
    @rule(data=st.data())
    def stage_work(self, data):
        """A stage worker's usual step: the next batch, its ``r`` written, acked."""
        self.stage_work_on(_pick(data, self.workers))

    def stage_work_on(self, w: Worker) -> None:
        meta = self._stage_get(w, TINY)
        if meta is not None and not meta.end:
            self._stage_finish(w, meta, "ack")

    @precondition(lambda self: self.live() and any(w.held for w in self.workers))
    @rule(data=st.data(), how=st.sampled_from(["ack", "ack", "release", "write"]))
    def stage_finish(self, data, how):
        w = _pick(data, [w for w in self.workers if w.held])
        meta = _pick(data, w.held)
        self._stage_finish(w, meta, how)

    def _stage_finish(self, w: Worker, meta: tq.BatchMeta, how: str) -> None:
        m = self.model
        if how == "release":
            w.client.release(meta)
            m.stage_holder[meta.step] = None
            w.held.remove(meta)
            return
        lost = w.client.put_data(meta, {"r": 2 * _values(meta.keys)})
        assert lost == [], lost
        m.wrote_r(meta.keys)
        if how == "ack":
            got = w.client.ack(meta)
            assert got == m.stage_acked(meta.step), (got, meta.keys)
            w.held.remove(meta)

    @precondition(lambda self: self.live() and self.workers)
    @rule(data=st.data(), cancel=st.booleans())
    def stage_kill(self, data, cancel):
        """A stage worker dies: cancelled (its session ends now) or just dropped (its
        heartbeat stops; its lease runs out after lease_timeout)."""
        w = _pick(data, self.workers)
        self.workers.remove(w)
        if cancel:
            w.client.cancel()
            w.session.cancelled = True
        else:
            w.session.dead_at = now()
        _drop(w, "client")

    @precondition(lambda self: self.live() and self.waits < MAX_WAITS and any(
        s.dead_at is not None for s in self.sessions))
    @rule()
    def wait_for_leases(self):
        """Time passes: every dead consumer's lease runs out."""
        self.waits += 1
        end = max(s.dead_at for s in self.sessions if s.dead_at is not None)
        time.sleep(max(0.0, end + LEASE + SLACK - now()) + 0.01)
        self.sessions = [s for s in self.sessions if s.dead_at is None]

    # ------------------------------------------------------------------ trainers
    def _trainer(self, slot: Slot) -> Trainer:
        tr = self.trainers[slot]
        if tr is not None:
            return tr
        r, k = slot
        spec = self.spec
        self.made += 1
        replica = {"replica": k} if spec.replicas > 1 or self.made % 2 else {}
        ds = tq.StreamingDataset(self.stream, P, "train", spec.fields, spec.batch_size,
                                 sampler=self._sampler(), dp_rank=r, dp_size=spec.dp_size,
                                 replicas=spec.replicas, timeout=WAIT,
                                 drop_last=spec.drop_last, **replica)
        tr = self.trainers[slot] = Trainer(slot, tq.StreamingDataLoader(ds))
        if slot == (0, 0) and self.model.version is not None:  # a restarted trainer
            tr.loader.set_version(self.model.version)
        return tr

    @precondition(lambda self: self.live())
    @rule(data=st.data(), n=st.integers(1, 4))
    def train(self, data, n):
        """A loop over the loader: n steps, then ``break``."""
        self._train(data.draw(st.sampled_from(self.spec.slots)), n, "break")

    @precondition(lambda self: self.live())
    @rule(data=st.data(), n=st.integers(1, 3))
    def train_fails(self, data, n):
        """A loop whose n-th step raises (a CUDA OOM), caught around the loop."""
        self._train(data.draw(st.sampled_from(self.spec.slots)), n, "raise")

    @precondition(lambda self: self.live())
    @rule(data=st.data(), n=st.integers(1, 3))
    def train_skips(self, data, n):
        """A loop that gives its n-th batch back on purpose: ``release()``, break."""
        self._train(data.draw(st.sampled_from(self.spec.slots)), n, "release")

    def _trained(self, tr: Trainer, step: int) -> None:
        """A step finished training: the leader bumps its version every N steps. A step
        trained again (after a crash) is no new step: the version changes at most once
        per step, as ``StreamingDataLoader.set_version`` requires of the trainer."""
        self.trained += 1
        self.trained_early += not self.done
        if tr.slot != (0, 0) or self.every is None or step in self.leader_trained:
            return
        self.leader_trained.add(step)
        self.leader_steps += 1
        if self.leader_steps % self.every == 0:
            v = (self.model.version or 0) + 1
            tr.loader.set_version(v)
            self.model.set_version(v)
            self.seen.add("version set while training")

    def _deliver(self, tr: Trainer, batch, to: Session, step: int | None = None):
        meta = tq.batch_meta(batch)
        m = self.model
        if step is None:
            step = m.next_step(tr.slot)
            if meta.step > step and self.spec.max_staleness is not None:
                m.skip_emptied(tr.slot, meta.step)  # steps left with no row: skipped
                self.seen.add("train: a step formed again with no row left was skipped")
                step = meta.step
        assert meta.step == step, (f"slot {tr.slot} got step {meta.step}, expected "
                                   f"{step}")
        before = m.holder.get((meta.step, *tr.slot), 0)
        if before is None:
            self.seen.add("train: a given-back batch came again")
        elif isinstance(before, Session) and before.dead_at is not None:
            self.seen.add("train: a dead reader's step came back")
        m.deliver_train(tr.slot, meta.step, meta.dp_rank, meta.replica, meta.keys, to)
        assert torch.equal(batch["x"], _values(meta.keys))
        if self.spec.pipeline:
            assert torch.equal(batch["r"], 2 * _values(meta.keys))
        return meta

    def _train(self, slot: Slot, n: int, exit: str) -> bool:
        """Returns True if the loop ran off the end of the stream."""
        m = self.model
        tr = self._trainer(slot)
        # the open iteration, if any: the for loop below must hold its only reference,
        # so that leaving the loop closes it right there (a break is seen as one)
        opened = [] if tr.open is None else [tr.open]
        if opened:
            session, out = tr.session, tr.out
            tr.open = tr.out = tr.session = None
            assert out is not None and session is not None
            if exit == "raise":  # the open step fails after all: close() gives it back
                opened.pop().close()
                session.cancelled = True
                m.give_back(slot, out.step)
                self.seen.add("train: an open loop closed by hand")
                return False
            self._trained(tr, out.step)
            if not m.can_go_on(slot, out.step):
                tr.loader.ack()  # trained; then the loop is closed by hand
                opened.pop().close()
                session.cancelled = True
                m.train_acked(slot, out.step)
                self.seen.add("train: an open loop closed by hand after ack()")
                return False
            m.train_acked(slot, out.step)  # acked when the next batch is asked for
        else:
            if not (m.available(slot) or m.train_end()):
                return False
            session = Session()
        count, last = 0, None
        try:
            for batch in (opened.pop() if opened else tr.loader):
                last = self._deliver(tr, batch, session)
                count += 1
                if exit == "raise" and count == n:
                    raise StepFailed(f"step {last.step} failed")
                if exit == "release" and count == n:
                    tr.loader.release()
                    m.give_back(slot, last.step)
                    break
                self._trained(tr, last.step)
                if count == n or not m.can_go_on(slot, last.step):
                    m.train_acked(slot, last.step)  # acked as the loop is left
                    break
                m.train_acked(slot, last.step)
            else:
                assert m.train_end(), f"slot {slot}'s loop ended while rows were left"
                self.seen.add("train: a loop ran off the end")
                return True
        except StepFailed:
            assert last is not None
            m.give_back(slot, last.step)
            self.seen.add("train: a step raised")
        finally:
            session.cancelled = True
        return False

    @precondition(lambda self: self.live())
    @rule(data=st.data())
    def train_open(self, data):
        """A trainer takes a batch and is still training it while others act."""
        slot = data.draw(st.sampled_from(self.spec.slots))
        tr = self._trainer(slot)
        if tr.open is not None:
            return
        if not self.model.available(slot):
            return
        it = iter(tr.loader)
        session = Session()
        tr.out = self._deliver(tr, next(it), session)
        tr.open, tr.session = it, session

    @precondition(lambda self: self.live() and any(self.trainers.values()))
    @rule(data=st.data())
    def train_kill(self, data):
        """A trainer dies (in the middle of a loop, or after a loop left by break);
        the next trainer of its slot resumes at the first step the slot has not
        acked."""
        slot = data.draw(st.sampled_from([s for s, t in self.trainers.items() if t]))
        tr = self.trainers[slot]
        assert tr is not None
        if tr.session is not None:
            tr.session.cancelled = True  # the dropped iteration's session is cancelled
        self.trainers[slot] = None
        _drop(tr, "loader", "open")
        self.seen.add("train: a trainer died")

    @precondition(lambda self: self.live() and any(t and t.open
                                                   for t in self.trainers.values()))
    @rule(data=st.data(), by_loader=st.booleans())
    def duplicate_replica(self, data, by_loader):
        """A second live consumer of a (dp_rank, replica) another live one reads: it is
        refused with a ConfigError naming ``replica``."""
        tr = _pick(data, [t for t in self.trainers.values() if t and t.open])
        assert tr.out is not None
        r, k = tr.slot
        spec = self.spec
        with pytest.raises(ConfigError, match="replica"):
            if by_loader:
                ds = tq.StreamingDataset(self.stream, P, "train", spec.fields,
                                         spec.batch_size, sampler=self._sampler(),
                                         dp_rank=r, dp_size=spec.dp_size,
                                         replicas=spec.replicas, replica=k,
                                         timeout=DUP_WAIT, drop_last=spec.drop_last)
                for batch in tq.StreamingDataLoader(ds):
                    self._deliver(tr, batch, Session(), tr.out.step)  # must fail
            else:
                meta = self.stream.client().get_meta(P, "train", tr.out.step, r,
                                                     timeout=DUP_WAIT, replica=k)
                self.model.deliver_train(tr.slot, meta.step, meta.dp_rank, meta.replica,
                                         meta.keys, Session())  # must fail
        self.seen.add("train: a duplicate replica was refused")

    @precondition(lambda self: self.live() and self.spec.replicas > 1)
    @rule()
    def missing_replica(self):
        """``replicas > 1`` without ``replica`` is refused, naming it."""
        spec = self.spec
        with pytest.raises(ConfigError, match="replica"):
            tq.StreamingDataset(self.stream, P, "train", spec.fields, spec.batch_size,
                                dp_size=spec.dp_size, replicas=spec.replicas)
        with pytest.raises(ConfigError, match="replica"):
            self.stream.client().get_meta(P, "train", 0, 0, timeout=TINY)

    @precondition(lambda self: self.live())
    @rule(data=st.data(), ahead=st.integers(0, 2),
          then=st.sampled_from(["ack", "ack", "release", "die"]))
    def read_step(self, data, ahead, then):
        """A low-level reader of a train step by number (DP lockstep control): it acks
        (a later step: a gap a loader skips), releases, or dies holding it."""
        slot = data.draw(st.sampled_from(self.spec.slots))
        tr = self.trainers[slot]
        if tr is not None and tr.open is not None:
            return
        m = self.model
        step = m.next_step(slot)
        for _ in range(ahead):
            step += 1
            while step in m.acked_steps[slot]:
                step += 1
        if not m.available(slot, step):
            return
        r, k = slot
        box = _Box(self.stream.client())  # its only reference: it may die below
        assert box.client is not None
        box.client.reading(P, "train", step)  # the trainer is at this step (versions)
        replica = k if self.spec.replicas > 1 or step % 2 else None
        meta = box.client.get_meta(P, "train", step, r, timeout=WAIT, replica=replica)
        session = Session()
        m.deliver_train(slot, meta.step, meta.dp_rank, meta.replica, meta.keys, session)
        assert meta.step == step
        if then == "ack":
            got = box.client.ack(meta)
            assert got == m.train_acked(slot, step), (got, meta.keys)
            if step > m.next_step(slot):
                self.seen.add("train: a gap of acked steps")
        elif then == "release":
            box.client.release(meta)
            m.give_back(slot, step)
        else:
            session.dead_at = now()
            self.sessions.append(session)
            _drop(box, "client")

    # ---------------------------------------------------------------- the end
    def drain(self) -> None:
        """Close the partition; the stage and every trainer consume to the end."""
        self.done = True
        m = self.model
        if not m.closed:
            self.close(by_writer=False)
        for w in list(self.workers):
            for meta in list(w.held):
                self._stage_finish(w, meta, "ack")
        w = self._join("w0")
        for _ in range(4 * len(m.rows) + 4):
            meta = self._stage_get(w, LEASE + WAIT)
            if meta is not None and meta.end:
                break
            if meta is not None:
                self._stage_finish(w, meta, "ack")
        else:
            raise AssertionError("the stage never reached the end")
        ended: set[Slot] = set()
        for _ in range(len(m.rows) + 8):
            for slot in self.spec.slots:
                if slot not in ended and self._train(slot, 10**6, "break"):
                    ended.add(slot)
            if len(ended) == len(self.spec.slots):
                break
        else:
            raise AssertionError(f"train never ended on {set(self.spec.slots) - ended}")
        self.stored_rows()
        self.counters()
        self.live_claims()
        m.check_accounted(self.stream.stats()[P]["tasks"], self.stream.stats()[P]["rows"])
        assert self.stream.kv.list(partition=P) == []

    # ---------------------------------------------------------------- invariants
    @invariant()
    def stored_rows(self):
        if hasattr(self, "model"):
            listed = {r["key"]: r["fields"] for r in self.stream.kv.list(partition=P)}
            self.model.check_stored(listed)

    @invariant()
    def counters(self):
        if hasattr(self, "model"):
            self.model.check_counts(self.stream.stats()[P]["tasks"])

    @invariant()
    def live_claims(self):
        """The controller's claims of live stage workers are what they hold."""
        if not hasattr(self, "model"):
            return
        leases = self.stream.stats()[P]["tasks"]["stage"]["leases"]
        for w in self.workers:
            mine = sorted(x["step"] for x in leases if x["session"] == w.client.session)
            assert mine == sorted(meta.step for meta in w.held), (mine, w.held)
            HEARTBEAT_AGES.extend(x["heartbeat_age"] for x in leases
                                  if x["session"] == w.client.session)


PublicAPIMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
    report_multiple_bugs=False,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPublicAPI = PublicAPIMachine.TestCase
