"""examples/verl_replay_buffer.py: verl's ReplayBuffer policy with tq_stream's samplers,
on rows written through the compat module (embedded)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

from examples import verl_replay_buffer  # noqa: E402


def test_validation_then_fresh_groups_with_signal():
    out = verl_replay_buffer.demo()
    # val first (no DAPO there), then the two fresh groups with reward variance; the
    # group two versions old and the all-equal-reward group were discarded, by reason
    assert out["groups"] == [["v1"], ["a"], ["b"]]
    assert out["discarded"] == {"stale": 4, "zero_variance": 4}
