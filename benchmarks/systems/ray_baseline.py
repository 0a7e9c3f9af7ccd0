"""The Ray baseline: the same TensorDict passed to and from one actor.

``put`` calls ``store.put.remote(keys, td)`` (Ray moves an argument over 100 KB through
the object store, i.e. a ``ray.put``) and waits; the actor keeps ``key -> (batch, row)``.
``get`` returns ``ray.get(store.get.remote(keys, fields))``; the actor gathers rows with
one index per batch (no gather when the keys are one whole earlier put, in order).
The actor is a plain (serial) Ray actor: concurrent callers queue on it.

Streaming: a second, asyncio actor is a FIFO of rows; producers ``put`` into it and each
consumer rank iterates a torch ``DataLoader`` over an ``IterableDataset`` whose
``take(batch_size)`` blocks in the actor until enough rows are ready. Every take pops
rows, so ranks and DataLoader workers get disjoint rows.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from benchmarks.systems import procs, ray_util
from benchmarks.systems.base import StreamSpec, System

NAMESPACE = "tq_stream_bench"


def _warm() -> int:
    """Import what unpickling a TensorDict needs (seconds on a small machine), return the pid."""
    import tensordict  # noqa: F401
    import torch  # noqa: F401

    return os.getpid()


class _RowStore:
    """Actor body: rows of earlier puts, by key."""

    def __init__(self) -> None:
        self._rows: dict[str, tuple[int, int]] = {}
        self._batches: dict[int, list[Any]] = {}  # id -> [TensorDict, live rows]
        self._ids = itertools.count()

    def pid(self) -> int:
        return _warm()

    def put(self, keys: list[str], td) -> int:
        bid = next(self._ids)
        self._batches[bid] = [td, 0]
        for i, key in enumerate(keys):
            self._drop(key)
            self._rows[key] = (bid, i)
            self._batches[bid][1] += 1
        return len(keys)

    def get(self, keys: list[str], fields: list[str] | None):
        import torch

        locs = [self._rows[k] for k in keys]  # KeyError names the missing key
        parts = []
        for bid, group in itertools.groupby(locs, key=lambda loc: loc[0]):
            rows = [r for _, r in group]
            td = self._batches[bid][0]
            if fields is not None:
                td = td.select(*fields)
            whole = rows == list(range(td.batch_size[0]))
            parts.append(td if whole else td[torch.tensor(rows)])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def clear(self, keys: list[str]) -> None:
        for key in keys:
            self._drop(key)

    def _drop(self, key: str) -> None:
        loc = self._rows.pop(key, None)
        if loc is not None:
            batch = self._batches[loc[0]]
            batch[1] -= 1
            if batch[1] == 0:
                del self._batches[loc[0]]


class _RowQueue:
    """Async actor body: a FIFO of rows handed out in batches of a requested size."""

    def __init__(self) -> None:
        import collections

        self._pieces: collections.deque = collections.deque()
        self._ready = 0
        self._cond = None

    def pid(self) -> int:
        return _warm()

    def _condition(self):
        import asyncio

        if self._cond is None:
            self._cond = asyncio.Condition()
        return self._cond

    async def put(self, keys: list[str], td) -> None:
        cond = self._condition()
        async with cond:
            self._pieces.append((list(keys), td))
            self._ready += len(keys)
            cond.notify_all()

    async def take(self, n: int, timeout_s: float):
        import asyncio

        import torch

        cond = self._condition()
        async with cond:
            try:
                await asyncio.wait_for(cond.wait_for(lambda: self._ready >= n), timeout_s)
            except TimeoutError:
                return None
            keys, tds = [], []
            while len(keys) < n:
                pkeys, td = self._pieces.popleft()
                need = n - len(keys)
                if len(pkeys) > need:  # split the piece, keep the rest at the front
                    self._pieces.appendleft((pkeys[need:], td[need:]))
                    pkeys, td = pkeys[:need], td[:need]
                keys += pkeys
                tds.append(td)
            self._ready -= n
            return keys, (tds[0] if len(tds) == 1 else torch.cat(tds))


class RayBaselineSystem(System):
    """A Ray actor holding ``key -> row``; see the module docstring."""

    name = "ray-baseline"
    supports_stream = True

    def __init__(self, num_cpus: int = ray_util.DEFAULT_NUM_CPUS) -> None:
        self._num_cpus = num_cpus
        self._owned = False
        self._store = None
        self._queue = None
        self._runs = itertools.count()
        self._queue_name = ""

    @classmethod
    def available(cls) -> tuple[bool, str]:
        return ray_util.ray_available()

    def start(self) -> None:
        import sys

        import ray
        from ray import cloudpickle

        # Ray workers need not be able to import ``benchmarks``: ship the actor classes by value
        cloudpickle.register_pickle_by_value(sys.modules[__name__])
        self._owned = ray_util.ensure_ray(self._num_cpus)
        self._store = ray.remote(num_cpus=0)(_RowStore).remote()
        ray.get(self._store.pid.remote())  # the actor process is up, its imports done

    def stop(self) -> None:
        import ray

        for actor in (self._store, self._queue):
            if actor is not None:
                ray.kill(actor)
        self._store = self._queue = None
        ray_util.shutdown(self._owned)
        self._owned = False

    def put(self, keys: list[str], td) -> None:
        import ray

        ray.get(self._store.put.remote(keys, td))

    def get(self, keys: list[str], fields: list[str] | None = None):
        import ray

        return ray.get(self._store.get.remote(keys, fields))

    def clear(self, keys: list[str]) -> None:
        import ray

        ray.get(self._store.clear.remote(keys))

    def pids(self) -> list[int]:
        """This process and its descendants: Ray's daemons and workers when Ray was started
        here; otherwise the actors are added explicitly."""
        import ray

        pids = procs.tree_pids()
        for actor in (self._store, self._queue):
            if actor is not None and not self._owned:
                pids.append(ray.get(actor.pid.remote()))
        return sorted(set(pids))

    # streaming
    def stream_setup(self, spec: StreamSpec) -> None:
        import ray

        self._queue_name = f"rows-{os.getpid()}-{next(self._runs)}"
        self._queue = (
            ray.remote(num_cpus=0)(_RowQueue)
            .options(name=self._queue_name, namespace=NAMESPACE, max_concurrency=64)
            .remote()
        )
        ray.get(self._queue.pid.remote())  # up and warm: its start is not streaming time

    def stream_teardown(self, spec: StreamSpec) -> None:
        import ray

        if self._queue is not None:
            ray.kill(self._queue)
            self._queue = None

    def stream_writer(self, spec: StreamSpec) -> _Writer:
        return _Writer(ray_util.address(), self._queue_name)

    def stream_reader(self, spec: StreamSpec, rank: int) -> _Reader:
        return _Reader(ray_util.address(), self._queue_name, spec.batch_size, spec.num_workers)

    def stream_keys(self, spec: StreamSpec, ids: list[Any]) -> list[str]:
        return list(ids)


def _queue_handle(address: str, name: str):
    import ray

    ray_util.connect(address)
    return ray.get_actor(name, namespace=NAMESPACE)


class _Writer:
    def __init__(self, address: str, queue_name: str) -> None:
        self.address, self.queue_name = address, queue_name
        self._q = None

    def open(self) -> None:
        self._q = _queue_handle(self.address, self.queue_name)
        _warm()

    def put(self, keys: list[str], td) -> None:
        import ray

        ray.get(self._q.put.remote(keys, td))

    def close(self) -> None:
        self._q = None


class _QueueDataset(IterableDataset):
    """Batches taken from the queue actor; connects to Ray lazily, in the loading process."""

    def __init__(self, address: str, queue_name: str, batch_size: int, ready: list) -> None:
        super().__init__()
        self.address, self.queue_name = address, queue_name
        self.batch_size, self.ready = batch_size, ready

    def __iter__(self):
        import ray

        q = _queue_handle(self.address, self.queue_name)
        info = get_worker_info()
        if info is not None:
            self.ready[info.id].set()
        while True:
            got = ray.get(q.take.remote(self.batch_size, 1.0))
            if got is not None:
                yield got


class _Reader:
    def __init__(self, address: str, queue_name: str, batch_size: int, num_workers: int):
        self.address, self.queue_name = address, queue_name
        self.batch_size, self.num_workers = batch_size, num_workers
        self._it = None
        self._loader = None

    def open(self) -> None:
        import multiprocessing as mp

        _warm()  # before the fork, so workers inherit the imports
        ctx = mp.get_context("fork")
        # a forked worker must not inherit a Ray connection: with workers, only they connect
        ready = [ctx.Event() for _ in range(self.num_workers)]
        if not self.num_workers:
            ray_util.connect(self.address)
        ds = _QueueDataset(self.address, self.queue_name, self.batch_size, ready)
        self._loader = DataLoader(
            ds,
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_identity,
            multiprocessing_context=ctx if self.num_workers else None,
            # in order, a batch one worker holds waits behind a worker blocked on an empty
            # queue: the stream's tail would never be yielded
            in_order=False,
        )
        self._it = iter(self._loader)
        for event in ready:  # Ray connection time is set-up, not streaming time
            event.wait(120.0)

    def batches(self):
        for keys, _td in self._it:
            yield keys

    def close(self) -> None:
        self._it = None
        self._loader = None


def _identity(x):
    return x
