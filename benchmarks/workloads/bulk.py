"""Workload 1: bulk put / get of all fields / get of one field, in GB/s and x memcpy.

Shapes follow TransferQueue's own perftest "small" case: 1024 rows x 9 float32 fields
x 8192 (302 MB). Variants: ragged rows (lengths uniform in 1..width) and an extra
string field. Each system gets the same TensorDict; the memcpy system is the limit.
"""

from __future__ import annotations

import torch
from tensordict import NonTensorStack, TensorDict

from benchmarks.workloads.common import Row, Shapes, best_time

VARIANTS = ("dense", "ragged", "string")


def make_data(shapes: Shapes, variant: str, seed: int = 0) -> tuple[TensorDict, int]:
    """The batch of a variant and its payload bytes (field names carry the variant, so
    variants never collide on one field's schema)."""
    g = torch.Generator().manual_seed(seed)
    n, f, w = shapes.bulk_rows, shapes.bulk_fields, shapes.bulk_width
    fields: dict = {}
    nbytes = 0
    for i in range(f):
        if variant == "ragged" and i == 0:
            lengths = torch.randint(1, w + 1, (n,), generator=g)
            rows = [torch.randn(int(k), generator=g) for k in lengths]
            fields[f"{variant}{i}"] = torch.nested.nested_tensor(rows, layout=torch.jagged)
            nbytes += int(lengths.sum()) * 4
        else:
            fields[f"{variant}{i}"] = torch.randn(n, w, generator=g)
            nbytes += n * w * 4
    if variant == "string":
        texts = [f"response {i}: " + "x" * (i % 200) for i in range(n)]
        fields["text"] = NonTensorStack.from_list(texts)
        nbytes += sum(len(t) for t in texts)
    return TensorDict(fields, batch_size=[n]), nbytes


def run(system, shapes: Shapes, variants: tuple[str, ...] = VARIANTS) -> list[Row]:
    rows: list[Row] = []
    for variant in variants:
        td, nbytes = make_data(shapes, variant)
        keys = [f"{variant}-{i}" for i in range(shapes.bulk_rows)]
        put_s = best_time(lambda td=td, keys=keys: system.put(keys, td), shapes.repeats)
        get_s = best_time(lambda keys=keys: system.get(keys, None), shapes.repeats)
        one = [k for k in td.keys() if k != "text"][-1]
        one_bytes = td[one].numel() * 4
        get1_s = best_time(lambda keys=keys, one=one: system.get(keys, [one]), shapes.repeats)
        system.clear(keys)
        gbs = 1e-9 * nbytes
        rows += [
            Row("bulk", f"{variant} put", system.name, gbs / put_s, "GB/s"),
            Row("bulk", f"{variant} get all", system.name, gbs / get_s, "GB/s"),
            Row("bulk", f"{variant} get one field", system.name, 1e-9 * one_bytes / get1_s,
                "GB/s"),
        ]
    return rows
