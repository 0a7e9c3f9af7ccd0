"""The examples run as a user runs them (README, "Use it in a training loop"), and
their printed results hold: every row reaches every task once, nothing is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]


def run(*args: str, timeout: float = 150) -> dict:
    """Runs a command from the repository root; returns its ``RESULT {...}`` line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:  # show how far it got
        out = (exc.stdout or b"").decode()[-3000:] + (exc.stderr or b"").decode()[-6000:]
        raise AssertionError(f"{args} ran longer than {timeout} s:\n{out}") from None
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.timeout(180)
def test_grpo_torchrun():
    r = run("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
            "examples/grpo_torchrun.py")
    assert r["rows_per_task"] == {"actor": 256, "old_logp": 256}
    assert r["stage_rows"] == 256  # the old-log-prob pool wrote every row once
    assert r["trained"] == 256 and r["duplicates"] == 0 and r["lost"] == 0
    assert r["replicas_identical"]  # TP peers got the same rows in the same order
    assert r["discarded"] == {}  # producers paced by reserve: nothing went stale


@pytest.mark.timeout(120)
def test_pipeline_stages():
    r = run("-m", "examples.pipeline_stages")
    tasks = ["ref_logp", "advantage", "actor"]
    assert r["rows_per_task"] == dict.fromkeys(tasks, 128)
    assert r["duplicates"] == dict.fromkeys(tasks, 0)
    assert r["lost"] == dict.fromkeys(tasks, 0)
    assert r["rows_left"] == 0  # freed once the last declared consumer acked


@pytest.mark.timeout(120)
def test_async_offpolicy():
    r = run("-m", "examples.async_offpolicy")
    assert r["produced"] == 192
    assert r["duplicates"] == 0 and r["lost"] == 0
    assert set(r["discarded"]) <= {"stale", "tail"}  # reasons, counted by the controller
    assert r["trained"] + sum(r["discarded"].values()) == r["produced"]
    assert r["steps"] == -(-r["trained"] // 8)  # one version bump per step


@pytest.mark.timeout(120)
def test_agent_media_flow():
    r = run("-m", "examples.agent_media_flow")
    assert r["trained_groups"] == 12 and r["trained_rows"] == 48  # 4 groups filtered
    assert r["filtered_rows"] == 16 and r["exact"]
    assert r["images_left"] == 0 and r["pins_left"] == 0  # freed: used, or filtered
    assert r["rows_left"] == 0 and r["unit_rows_left"] == 0
    assert r["exit_codes"] == [0, 0]
