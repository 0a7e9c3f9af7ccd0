"""A jagged field read back pads to its longest row (found by the GRPO example: the
nested tensor from get_data padded to the total token count, so a mask built from
its lengths no longer matched ``to_padded_tensor``)."""

from __future__ import annotations

import torch

import tq_stream as tq


def test_a_jagged_field_pads_to_its_longest_row(stream):
    rows = [torch.arange(n, dtype=torch.float32) for n in (5, 9, 3)]
    stream.writer("p").put(["a", "b", "c"],
                           {"r": torch.nested.nested_tensor(rows, layout=torch.jagged)})
    c = stream.client()
    c.register_task("p", "t", ["r"], batch_size=3)
    got = c.get_data(c.get_meta("p", "t", 0))["r"]
    padded = got.to_padded_tensor(0.0)
    assert padded.shape == (3, 9)
    assert torch.equal(padded[1], rows[1])
    part = tq.select_rows(tq.datasets.batch.attach_meta(
        c.get_data(c.get_meta("p", "t", 0)), c.get_meta("p", "t", 0), 0), [0, 2])
    assert part["r"].to_padded_tensor(0.0).shape == (2, 5)
