"""Issue 20 item 16 in local mode: a parent field name (``"obs"``) reads the subtree
through DataLoader workers, a Client and the KV facade (embedded twin:
tests/api/test_nested_parent_read.py)."""

from __future__ import annotations

import pytest
from tensordict import TensorDict

from tests.helpers.nested_cases import check_obs, loader_reads_the_subtree, put_obs
from tests.helpers.tq_fixtures import local_stream

__all__ = ["local_stream"]

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.mark.parametrize("workers", [0, 1])
def test_the_loader_reads_a_parent_field(local_stream, workers):
    seen = loader_reads_the_subtree(local_stream, f"nested{workers}", num_workers=workers,
                                    multiprocessing_context="fork" if workers else None)
    assert seen == list(range(16))


def test_client_and_kv_read_a_parent_field(local_stream):
    keys = put_obs(local_stream, "nestedc", 4)
    client = local_stream.client()
    client.register_task("nestedc", "t", ["obs"], 4)
    meta = client.get_meta("nestedc", "t", step=0, timeout=20)
    assert check_obs(client.get_data(meta, ["obs"])) == [0, 1, 2, 3]
    assert check_obs(local_stream.kv.get_batch(keys, fields=["obs"],
                                               partition="nestedc")) == [0, 1, 2, 3]
    row = local_stream.kv.get("k2", fields=["obs"], partition="nestedc")
    assert isinstance(row["obs"], TensorDict) and row["obs"]["state"].item() == 2
