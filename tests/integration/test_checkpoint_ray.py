"""Checkpoints of a Ray deployment on two nodes: each unit actor writes and reads its own
file (here both nodes share this machine's filesystem, as shared storage would)."""

from __future__ import annotations

import os

import pytest
import torch
from checkpoint_cases import save_under_load
from tq_fixtures import ray_cluster

import tq_stream as tq

__all__ = ["ray_cluster"]  # the session-scoped fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.timeout(240)]

CONFIG = tq.StreamConfig(timeout=60)


def test_units_on_two_nodes_save_and_restore_their_own_files(ray_cluster, tmp_path):
    path = str(tmp_path / "ckpt")
    with tq.init(mode="ray", storage_units=2, config=CONFIG) as stream:
        assert sorted(stream._owner.unit_nodes) == sorted(ray_cluster), "one unit per node"
        checked = save_under_load(stream, str(tmp_path), lambda p: tq.init(
            mode="ray", storage_units=2, config=CONFIG, restore=p, name="tq_restored"),
            saves=2)
        keys = [f"r{i}" for i in range(16)]
        x = torch.arange(32, dtype=torch.float32).reshape(16, 2)
        stream.writer("p").put(keys, {"x": x})
        stream.save(path)
    assert checked > 0
    assert len([n for n in os.listdir(path) if n.startswith("unit-")]) == 2
    with tq.init(mode="ray", storage_units=2, config=CONFIG, restore=path) as stream:
        assert torch.equal(stream.kv.get_batch(keys, ["x"], partition="p")["x"], x)
