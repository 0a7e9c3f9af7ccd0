"""TP/PP peers as torch.distributed ranks (issue 20, item 3, replayed the way it was
found): 4 gloo processes, DP 2 x 2 replicas, DataLoader workers 2, local mode.

The replay: without ``replica`` both peers acked as replica 0, and at the end 128 of
128 rows were still leased and nothing was freed. ``replicas > 1`` without ``replica``
is refused (tests/integration/controller/test_claims_local.py); here, peers that pass
``replica=rank % 2`` free every row, and peers that all claim replica 0 are refused,
one of each pair, naming ``replica``, with no step trained by both."""

from __future__ import annotations

from pathlib import Path

import pytest

import tq_stream as tq
from tests.helpers.tq_fixtures import local_stream, run_workers
from tests.helpers.tq_workers import gloo_rank, values

__all__ = ["local_stream"]  # the module-scoped fixture, imported for pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
WORLD = 4
ROWS = 128


def _ranks(stream: tq.Stream, part: str, replica_of: str, tmp: Path) -> list[tuple]:
    """A closed partition of ROWS rows, consumed by task "t" (declared), and the
    reports of the 4 ranks that read it."""
    stream.create_partition(part, consumers=["t"])
    ks = [f"{part}_{i}" for i in range(ROWS)]
    stream.writer(part).put(ks, {"x": values(ks)})
    stream.close_partition(part)
    init = str(tmp / f"{part}.init")
    return run_workers(gloo_rank, [(rank, WORLD, init, stream, part, replica_of)
                                   for rank in range(WORLD)], report_s=120.0)


def test_peers_with_their_replica_free_every_row(local_stream, tmp_path):
    reports = _ranks(local_stream, "peers", "peer", tmp_path)
    assert [err for _, _, err in reports] == [""] * WORLD, reports
    for dp in (0, 1):  # TP peers trained the same steps, the same rows
        assert reports[2 * dp][:2] == reports[2 * dp + 1][:2]
    a, b = (set(reports[r][1]) for r in (0, 2))
    assert not a & b and len(a | b) == ROWS  # each row to one DP rank
    stats = local_stream.stats()["peers"]
    assert stats["rows"] == 0, stats  # every replica acked: freed
    assert stats["tasks"]["t"]["leased"] == 0, stats


def test_peers_that_all_claim_replica_zero_are_refused(local_stream, tmp_path):
    reports = _ranks(local_stream, "zeros", "zero", tmp_path)
    for dp in (0, 1):
        pair = reports[2 * dp: 2 * dp + 2]
        errors = [err for _, _, err in pair if err]
        assert errors and all("replica" in e for e in errors), pair
        assert not set(pair[0][0]) & set(pair[1][0]), pair  # no step to both
