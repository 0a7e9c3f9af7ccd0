"""The embedded demo delivers every row exactly once."""

from __future__ import annotations

from tq_stream.demo import DemoConfig, run


def test_demo_small():
    summary = run(DemoConfig(prompts=32, group_size=4), quiet=True)
    assert summary["rows"] == 128
    assert summary["duplicates"] == 0 and summary["missing"] == 0
    assert summary["delivered"] == 128 and summary["rows_left"] == 0
    assert summary["discarded"] == {}
