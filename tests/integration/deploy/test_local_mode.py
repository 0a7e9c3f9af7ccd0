"""Local mode: everything the embedded mode does, with the controller and two storage
units in child processes (one deployment for the module, one partition per test)."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections import Counter

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import initialize
from tensordict import TensorDict

import tests.controller.test_properties as core
import tq_stream as tq
from tests.helpers.tq_fixtures import (
    CONFIG,
    alive,
    kill,
    local_stream,
    segments_of,
    start_local,
    wait_gone,
    wait_until,
)
from tests.helpers.tq_workers import produce, values
from tq_stream.connection.remote_unit import RemoteUnit
from tq_stream.connection.same_host import SameHostUnit
from tq_stream.datasets.workers import SpawnStartWarning
from tq_stream.errors import StateError

__all__ = ["local_stream"]  # the module-scoped fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def put(stream: tq.Stream, partition: str, keys: list[str], **kw: object) -> None:
    stream.writer(partition, **kw).put(keys, {"x": values(keys)})


# ---------------------------------------------------------------- data paths


def test_dense_ragged_and_object_fields_round_trip(local_stream):
    keys = [f"r_{i}" for i in range(6)]
    ragged = [torch.arange(i + 1, dtype=torch.int64) * 10 for i in range(6)]
    objs = [{"s": f"v{i}", "n": [i, i * 2]} for i in range(6)]
    w = local_stream.writer("rt")
    w.put(keys, TensorDict({"x": values(keys)}, [6]), tags=[{"uid": k} for k in keys])
    w.put(keys, {"resp": torch.nested.nested_tensor(ragged, layout=torch.jagged),
                 "meta": objs})  # fields added later (upsert)
    order = keys[::-1]
    td = local_stream.kv.get_batch(order, partition="rt")
    assert torch.equal(td["x"], values(order))
    assert [t.tolist() for t in td["resp"].unbind()] == [ragged[5 - i].tolist()
                                                         for i in range(6)]
    assert td["meta"].tolist() == objs[::-1]
    padded = local_stream.kv.get_batch(keys, fields=["resp"], partition="rt", ragged="padded")
    assert padded["resp"].shape == (6, 6) and padded["resp"][5].tolist() == ragged[5].tolist()
    one = local_stream.kv.get("r_2", partition="rt")
    assert one["meta"] == objs[2] and torch.equal(one["x"], values(["r_2"])[0])


def test_kv_put_get_list_clear(local_stream):
    kv = local_stream.kv
    kv.put("a_1", {"x": torch.ones(3), "name": "first"}, tag={"v": 1}, partition="kv")
    kv.put_batch(["a_2", "a_3"], {"x": torch.zeros(2, 3), "name": ["s", "t"]},
                 tags=[{"v": 2}, {"v": 3}], partition="kv")
    assert kv.get("a_1", partition="kv")["name"] == "first"
    listed = kv.list(partition="kv")
    assert [r["key"] for r in listed] == ["a_1", "a_2", "a_3"]
    assert [r["tags"]["v"] for r in listed] == [1, 2, 3]
    assert kv.clear(["a_1", "a_3"], partition="kv") == 2
    assert [r["key"] for r in kv.list(partition="kv")] == ["a_2"]
    assert kv.clear(partition="kv") == 1 and kv.list(partition="kv") == []


def test_rows_spread_over_units_and_a_batch_assembles_from_both(local_stream):
    keys = [f"s_{i}" for i in range(16)]
    put(local_stream, "shard", keys)
    meta = local_stream.kv.meta(keys, partition="shard")
    assert Counter(meta.unit.tolist()) == {0: 8, 1: 8}
    mixed = keys[::3] + keys[1::3]
    assert torch.equal(local_stream.kv.get_batch(mixed, partition="shard")["x"], values(mixed))
    pinned = [f"s_{i}" for i in range(16, 20)]
    put(local_stream, "shard", pinned, unit=1)
    assert set(local_stream.kv.meta(pinned, partition="shard").unit.tolist()) == {1}


def test_writer_prefers_a_unit_on_its_own_host(local_stream):
    backend = local_stream.connection.backend
    infos = backend.controller().units()
    elsewhere = [msgspec.structs.replace(infos[0], host="another-host"), infos[1]]
    ctrl = backend.controller()
    ctrl.units = lambda: elsewhere  # this process sees unit 0 on another host
    backend._unit_hosts = None  # the backend asks once per process: ask again
    try:
        assert backend.preferred_unit() == 1
        keys = [f"h_{i}" for i in range(6)]
        put(local_stream, "host", keys)
    finally:
        del ctrl.units
        backend._unit_hosts = None
    assert set(local_stream.kv.meta(keys, partition="host").unit.tolist()) == {1}


def test_same_host_reads_shared_memory_other_hosts_read_frames(local_stream, monkeypatch):
    keys = [f"f_{i}" for i in range(8)]
    put(local_stream, "frames", keys)
    assert all(isinstance(u, SameHostUnit) for u in local_stream.connection.units())
    from tq_stream import hosts

    monkeypatch.setattr(hosts, "host_id", lambda: "another-host")
    with tq.connect(local_stream.address, config=CONFIG) as remote:
        assert all(type(u) is RemoteUnit for u in remote.connection.units())
        assert torch.equal(remote.kv.get_batch(keys, partition="frames")["x"], values(keys))


@pytest.mark.parametrize("via", ["embedded", "same_host", "frames"])
def test_a_cleared_and_reused_slot_is_never_read_as_the_old_row(local_stream, monkeypatch,
                                                                 via):
    part = f"gen_{via}"
    if via == "frames":
        from tq_stream import hosts

        monkeypatch.setattr(hosts, "host_id", lambda: "another-host")
    handle = tq.init(storage_units=2) if via == "embedded" else \
        tq.connect(local_stream.address, config=CONFIG)
    with handle as s:
        s.writer(part, unit=0).put(["g_0", "g_1"], {"x": values(["g_0", "g_1"]),
                                                    "o": ["old0", "old1"]})
        old = s.kv.meta(["g_0"], partition=part)
        s.kv.clear(["g_0"], partition=part)
        fresh = [f"g_{i}" for i in range(2, 40)]  # more rows than a writer keeps spare
        s.writer(part, unit=0).put(fresh, {"x": values(fresh), "o": fresh})
        metas = s.kv.meta(fresh, partition=part)
        reused = np.flatnonzero(metas.slot == old.slot[0])
        assert len(reused) == 1, "the cleared row's slot was not reused"
        new = metas.select(reused)
        for fields in (["x"], ["o"], ["x", "o"]):
            with pytest.raises(StateError, match="cleared"):
                s.client().get_data(old, fields)
        got = s.client().get_data(new)
        assert got["o"].tolist() == list(new.keys)
        assert torch.equal(got["x"], values(list(new.keys)))


# ------------------------------------------------------------------ consumers


def test_group_sampler_two_dp_ranks_in_threads(local_stream):
    n_groups, group = 12, 4
    keys = [f"gr_{i}" for i in range(n_groups * group)]
    tags = [{"uid": f"u{i // group}"} for i in range(len(keys))]
    local_stream.writer("grp").put(keys, {"x": values(keys)}, tags=tags)
    local_stream.close_partition("grp")
    got: dict[int, list[tq.BatchMeta]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            ds = tq.StreamingDataset(local_stream, "grp", "grpo", ["x"], batch_size=8,
                                     sampler=tq.samplers.GroupSampler(group_size=group),
                                     dp_rank=r, dp_size=2, timeout=20)
            for batch in tq.StreamingDataLoader(ds):
                meta = tq.batch_meta(batch)
                assert torch.equal(batch["x"], values(list(meta.keys)))
                got[r].append(meta)
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    assert not errors, errors
    assert len(got[0]) == len(got[1]) == n_groups // 4
    for m0, m1 in zip(got[0], got[1], strict=True):
        assert m0.step == m1.step and not set(m0.keys) & set(m1.keys)
        for m in (m0, m1):
            assert set(Counter(t["uid"] for t in m.tags).values()) == {group}
    delivered = [k for r in (0, 1) for m in got[r] for k in m.keys]
    assert sorted(delivered) == sorted(keys)


@pytest.mark.timeout(90)
def test_spawned_process_connects_and_produces(local_stream):
    child = mp.get_context("spawn").Process(
        target=produce, args=(local_stream, local_stream.address, "child", 10))
    child.start()
    try:
        child.join(75)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            kill(child.pid)
            child.join(5)
    rows = local_stream.kv.list(partition="child")
    assert len(rows) == 10 and {r["tags"]["pid"] for r in rows} == {child.pid}
    ds = tq.StreamingDataset(local_stream, "child", "read", ["x"], batch_size=3)
    keys = [k for b in tq.StreamingDataLoader(ds) for k in tq.batch_meta(b).keys]
    assert sorted(keys) == sorted(f"c_{i}" for i in range(10))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_deliver_every_row_once(local_stream, context):
    part = f"dl_{context}"
    keys = [f"w_{i}" for i in range(48)]
    put(local_stream, part, keys)
    local_stream.close_partition(part)
    ds = tq.StreamingDataset(local_stream, part, "train", ["x"], batch_size=4, timeout=60)
    with warnings.catch_warnings():  # spawn is flagged (SpawnStartWarning), and works
        warnings.simplefilter("ignore", SpawnStartWarning)
        loader = tq.StreamingDataLoader(ds, num_workers=2, multiprocessing_context=context)
    seen: list[str] = []
    for batch in loader:
        meta = tq.batch_meta(batch)
        assert torch.equal(batch["x"], values(list(meta.keys)))
        seen += meta.keys
    assert sorted(seen) == sorted(keys), Counter(seen).most_common(3)
    stats = local_stream.stats()[part]["tasks"]["train"]
    assert stats["acked"] == len(keys) and stats["leased"] == 0


def _produce_one_by_one(stream: tq.Stream, partition: str, prefix: str, n: int) -> None:
    w = stream.writer(partition)
    for i in range(n):
        key = f"{prefix}_{i}"
        w.put([key], {"x": values([key])})  # one row per put: the shared-memory path


@pytest.mark.timeout(120)
def test_rows_written_into_shared_memory_while_consumed_arrive_intact(local_stream):
    """Two producer processes copy rows into the units' shared memory one by one while a
    loader consumes and acks them, so the partition empties and fills again, slabs grow
    and stores are dropped and made again under the writers: every row arrives once,
    with its own values."""
    part = "shared_stream"
    local_stream.create_partition(part)
    ctx = mp.get_context("fork")
    producers = [ctx.Process(target=_produce_one_by_one, args=(local_stream, part, p, 300))
                 for p in ("p", "q")]
    for proc in producers:
        proc.start()
    ds = tq.StreamingDataset(local_stream, part, "t", ["x"], batch_size=4, timeout=60)
    seen: list[str] = []
    for batch in tq.StreamingDataLoader(ds):
        meta = tq.batch_meta(batch)
        assert torch.equal(batch["x"], values(list(meta.keys)))
        seen += meta.keys
        if len(seen) == 600:
            break
    for proc in producers:
        proc.join(30)
        assert proc.exitcode == 0
    assert sorted(seen) == sorted(f"{p}_{i}" for p in ("p", "q") for i in range(300))


def test_save_and_restore(local_stream, tmp_path):
    keys = [f"ck_{i}" for i in range(10)]
    local_stream.create_partition("ckpt", consumers=["t"])
    local_stream.writer("ckpt").put(keys, {"x": values(keys), "o": keys},
                                    tags=[{"v": i} for i in range(10)])
    client = local_stream.client()
    client.register_task("ckpt", "t", ["x"], batch_size=4)
    first = client.get_meta("ckpt", "t", step=0)
    client.ack(first)
    path = str(tmp_path / "ckpt.tqs")
    local_stream.save(path)
    restored = start_local(restore=path)
    try:
        left = [k for k in keys if k not in first.keys]  # acked rows were freed
        assert [r["key"] for r in restored.kv.list(partition="ckpt")] == left
        assert restored.kv.list(partition="ckpt") == local_stream.kv.list(partition="ckpt")
        td = restored.kv.get_batch(left, partition="ckpt")
        assert torch.equal(td["x"], values(left)) and td["o"].tolist() == left
        restored.close_partition("ckpt")
        ds = tq.StreamingDataset(restored, "ckpt", "t", ["x"], batch_size=4)
        ds.start_step = 1  # step 0 was acked before the checkpoint
        rest = [k for b in tq.StreamingDataLoader(ds) for k in tq.batch_meta(b).keys]
        assert sorted(rest + list(first.keys)) == sorted(keys)
    finally:
        restored.close()


# ----------------------------------------------------------- delivery property
# The core delivery machine (tests/controller/test_properties.py), run on local deployments.

_CORE = getattr(core, "DeliveryMachine", None)
_RULE = getattr(getattr(_CORE, "setup", None), "hypothesis_stateful_initialize_rule", None)

if _RULE is not None:

    class LocalDeliveryMachine(_CORE):
        """The core delivery properties on a local deployment (one per example).

        Lease expiry there runs on a fake clock the child controller does not see, so
        in local mode that rule only marks leases as maybe expired (acks succeed)."""

        @initialize(**_RULE.arguments)
        def setup(self, **kw):
            real = tq.init
            tq.init = lambda *a, **k: real(*a, **{**k, "mode": "local", "storage_units": 2})
            try:
                _CORE.setup(self, **kw)
            finally:
                tq.init = real

    LocalDeliveryMachine.TestCase.settings = settings(
        max_examples=5, stateful_step_count=20, deadline=None, derandomize=True,
        suppress_health_check=list(HealthCheck))
    TestLocalDelivery = pytest.mark.timeout(120)(LocalDeliveryMachine.TestCase)
else:

    @pytest.mark.skip(reason="tests/controller/test_properties.py has no DeliveryMachine with an "
                             "@initialize setup to run on local mode")
    def test_core_delivery_properties_on_local_mode():
        pass


# ----------------------------------------------------------------- lifecycle

_HOLDER = """
import sys, torch
import tq_stream as tq
s = tq.init(mode="local", storage_units=2)
s.writer("p").put(["a", "b"], {"x": torch.ones(2, 64)})
procs = s.processes()
print(" ".join(str(p.pid) for p in procs), procs[0].folder, flush=True)
sys.stdin.readline()  # then exit without closing the stream
"""


@pytest.mark.timeout(180)
def test_no_orphans_when_the_owner_exits_or_is_killed():
    """A process that started a deployment exits without closing it, or dies by SIGKILL
    or SIGTERM: its servers exit and their shared memory is removed."""
    ends = {"exit": 0, "SIGKILL": -signal.SIGKILL, "SIGTERM": -signal.SIGTERM}
    holders = {end: subprocess.Popen([sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True) for end in ends}
    servers: dict[str, list[int]] = {}
    folders: dict[str, str] = {}
    try:
        for end, proc in holders.items():
            line = proc.stdout.readline()
            assert line, f"holder exited with {proc.wait(10)}"
            *pids, folder = line.split()
            servers[end] = [int(p) for p in pids]
            folders[end] = folder
            assert all(alive(p) for p in servers[end]) and segments_of(servers[end][1:])
        for end, proc in holders.items():
            if end == "exit":
                proc.stdin.write("\n")
                proc.stdin.flush()
            else:
                proc.send_signal(getattr(signal, end))
        for end, proc in holders.items():
            assert proc.wait(40) == ends[end]  # generous: the suite may load both cores
            assert wait_gone(servers[end], 40.0) == [], f"orphans after {end}"
            assert segments_of(servers[end]) == []
            assert wait_until(lambda f=folders[end]: not os.path.exists(f), 10.0), \
                f"{end}: the servers leave no socket folder behind"
    finally:
        for proc in holders.values():
            if proc.poll() is None:
                kill(proc.pid)
                proc.wait(5)
            proc.stdin.close()
            proc.stdout.close()
        for pids in servers.values():
            for p in pids:
                kill(p)



def _deleted_shm_mapped() -> int:
    """Bytes this process still maps of /dev/shm/tq_* files that were unlinked."""
    total = 0
    with open("/proc/self/maps") as f:
        for line in f:
            if "/dev/shm/tq_" in line and line.rstrip().endswith("(deleted)"):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                total += hi - lo
    return total


def test_a_reader_lets_go_of_cleared_segments(local_stream):
    keys = [f"big{i}" for i in range(768)]
    data = torch.randn(768, 16384)  # 24 MiB per unit: unlinked when cleared, never kept
    local_stream.kv.put_batch(keys, {"x": data}, partition="letgo")
    assert torch.equal(local_stream.kv.get_batch(keys, partition="letgo")["x"], data)
    local_stream.kv.clear(keys, partition="letgo")
    del data
    gc.collect()
    # The next call that touches each unit drops its stale layouts and mappings.
    local_stream.kv.put_batch(["s0", "s1"], {"x": torch.zeros(2, 4)}, partition="letgo2")
    local_stream.kv.get_batch(["s0", "s1"], partition="letgo2")
    gc.collect()
    assert _deleted_shm_mapped() < (1 << 20)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_ipc_transport_works_and_removes_its_socket_folder():
    stream = tq.init(mode="local", storage_units=1, transport="ipc")
    folder = stream.processes()[0].folder
    try:
        assert stream.address.startswith("ipc://")
        stream.writer("ipc").put(["a"], {"x": torch.ones(1, 2)})
        assert torch.equal(stream.kv.get("a", partition="ipc")["x"], torch.ones(2))
    finally:
        stream.close()
    assert not os.path.exists(folder)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_large_dense_puts_write_straight_into_shared_memory(local_stream):
    backend = local_stream.connection.backend
    units = backend.units()
    assert all(isinstance(u, SameHostUnit) for u in units)
    calls: list[str] = []
    for u in units:
        rpc = u.remote.client.transport
        original = rpc.call

        def spy(method, args=None, timeout=None, _orig=original):
            calls.append(method)
            return _orig(method, args, timeout=timeout)

        u.remote.client.transport.call = spy
    try:
        w = local_stream.writer("direct")
        for n in (64, 640):  # the second put grows the slabs under the first rows
            keys = [f"d{n}_{i}" for i in range(n)]
            data = torch.randn(n, 8192)  # 32 KiB rows: over the direct-write threshold
            w.put(keys, {"x": data})
            assert torch.equal(local_stream.kv.get_batch(keys, partition="direct")["x"], data)
        assert "prepare_write" in calls and "finish_write" in calls
        assert "put" not in calls  # no bytes went through the socket
        first = [f"d64_{i}" for i in range(64)]
        local_stream.kv.clear(first, partition="direct")
        with pytest.raises(tq.errors.KeyConflictError):
            local_stream.kv.get_batch(first, partition="direct")
        # Mixed rows: the dense and ragged fields go straight in, only the object field
        # uses the socket (with the finish_write).
        sent: list[list[str]] = []
        for u in units:
            u.remote.finish_write = (lambda p, t, ok=True, cols=None, _o=u.remote.finish_write:
                                      sent.append(sorted(cols or {})) or _o(p, t, ok, cols))
        keys = [f"m{i}" for i in range(64)]
        dense = torch.randn(64, 8192)
        ragged = [torch.arange(i + 1) for i in range(64)]
        texts = [f"row {i}" for i in range(64)]
        w.put(keys, {"x": dense, "r": ragged, "text": texts})
        got = local_stream.kv.get_batch(keys, partition="direct", ragged="padded")
        assert torch.equal(got["x"], dense) and got["text"] == texts
        assert [int(v) for v in got["r"][:, :].max(dim=1).values] == list(range(64))
        assert sent and all(cols == ["text"] for cols in sent)
    finally:
        for u in units:
            del u.remote.client.transport.call
            u.remote.__dict__.pop("finish_write", None)


def test_a_failed_start_raises_its_own_error_and_leaves_nothing(monkeypatch, tmp_path):
    """A server that exits during start is the error the caller sees; the cleanup used to
    fail first (AttributeError: no attribute '_stop') and leave the socket folder."""
    import glob
    import tempfile

    from tq_stream.deploy import local
    from tq_stream.errors import StateError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    started = []

    def fail(children, timeout):
        started.extend(c.pid for c in children)
        raise StateError("a tq_stream server (pid 1) exited during start with code 1")

    monkeypatch.setattr(local, "await_ready", fail)
    with pytest.raises(StateError, match="exited during start"):
        tq.init(mode="local", storage_units=2, checkpoint_interval=1.0)
    assert started and glob.glob(str(tmp_path / "tq_*")) == []
    for pid in started:
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reaped: not left running
