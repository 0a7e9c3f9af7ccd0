"""stream.save and restore hold one chunk of rows at a time, not the whole partition.

Each runs in a fresh process whose peak resident memory (``VmHWM``, reset just before)
is compared with what it held before: a save of 160 MiB of rows may add about one chunk,
a restore the rows it stores plus about one chunk (a whole-file read or copy would add
160 MiB more).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import tq_stream as tq
from tests.conftest import assert_same_snapshot, nested, snapshot
from tq_stream import recordfile
from tq_stream.backends import unit_files

ROW_FLOATS = 1 << 18  # 1 MiB per row
ROWS = 160
CHUNK = 8 << 20
SLACK = 64 << 20  # allocator, interpreter and deployment noise, beside one chunk

PRELUDE = textwrap.dedent(f"""
    import gc, json, sys
    import torch
    import tq_stream as tq
    from tq_stream.backends import unit_files
    unit_files.CHUNK_BYTES = {CHUNK}

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def peak():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f
                        if line.startswith("VmHWM"))

    def start():
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident memory (VmHWM) starts again from now
        return rss()
""")

SAVE = PRELUDE + textwrap.dedent(f"""
    with tq.init() as stream:
        stream.create_partition("p", capacity={ROWS})
        for i in range({ROWS} // 4):
            keys = [f"k{{i}}_{{j}}" for j in range(4)]
            stream.writer("p").put(keys, {{"x": torch.full((4, {ROW_FLOATS}), float(i))}})
        before = start()
        stream.save(sys.argv[1])
        print(json.dumps({{"before": before, "peak": peak(), "rss": rss()}}))
""")

RESTORE = PRELUDE + textwrap.dedent("""
    tq.init().close()  # what a deployment imports is no row's memory
    before = start()
    with tq.init(restore=sys.argv[1]) as stream:
        last = stream.kv.get("k39_3", partition="p")["x"]
        print(json.dumps({"before": before, "peak": peak(), "rss": rss(),
                          "rows": stream.stats()["p"]["rows"], "last": float(last[0])}))
""")


def _run(script: str, path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, "-c", script, path], capture_output=True,
                         text=True, timeout=240, env=env, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux procfs")
def test_save_and_restore_of_a_large_partition_hold_about_one_chunk(tmp_path):
    data = ROWS * ROW_FLOATS * 4
    path = str(tmp_path / "ckpt")
    saved = _run(SAVE, path)
    assert saved["peak"] - saved["before"] <= CHUNK * 2 + SLACK, saved
    restored = _run(RESTORE, path)
    assert restored["rows"] == ROWS and restored["last"] == ROWS // 4 - 1
    # the rows stored, plus what the deployment's start makes beside them
    assert restored["peak"] - restored["before"] <= data + CHUNK * 2 + 2 * SLACK, restored


def test_a_unit_file_is_written_in_chunks_of_the_chunk_size(tmp_path, monkeypatch):
    monkeypatch.setattr(unit_files, "CHUNK_BYTES", 1 << 20)
    path = str(tmp_path / "ckpt")
    with tq.init() as stream:
        stream.create_partition("train")
        keys = [f"k{i}" for i in range(64)]
        stream.writer("train").put(keys, {"x": torch.arange(64 * 32768.0).reshape(64, 32768),
                                      "r": nested([torch.ones(i + 1) for i in range(64)]),
                                      "s": [str(i) for i in range(64)]})
        stream.save(path)
        before = snapshot(stream)
    unit_file = next(os.path.join(path, f) for f in os.listdir(path) if f.startswith("unit-"))
    chunks = list(recordfile.read(unit_file))[1:]
    assert len(chunks) >= 8
    for chunk in chunks:
        x = chunk["fields"]["x"]["column"]
        assert x.numel() * 4 <= (1 << 20)
    with tq.init(restore=path) as stream:
        assert_same_snapshot(before, snapshot(stream))


def test_a_unit_file_of_format_1_is_still_read(tmp_path):
    from tq_stream import framefile
    from tq_stream.backends.memory import MemoryUnit

    path = str(tmp_path / "unit-0-abc.tq")
    slots, tokens = np.array([2, 0]), np.array([7, 8])
    framefile.dump({"format": 1, "save": "abc", "unit": 0, "partitions": {"p": {
        "slots": slots, "tokens": tokens,
        "fields": {"x": {"slots": slots, "column": torch.tensor([[1.0], [2.0]])}}}}}, path)
    unit = MemoryUnit()
    try:
        loaded = unit_files.load(unit, path, "abc", 0)
        assert loaded["p"][0].tolist() == [2, 0]
        got = unit.get("p", np.array([0, 2]), ["x"], np.array([8, 7]))["x"]
        assert got.flatten().tolist() == [2.0, 1.0]
    finally:
        unit.close()
