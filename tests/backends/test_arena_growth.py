"""How far arenas grow: a ragged or multi-ragged arena filled by many puts holds little
more than its values (issue 23, "Memory with a bound"), on the heap without copying its
rows at each growth (``heap.HeapAlloc``), and a budget counts what a growth adds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tq_stream.backends.alloc import STEP
from tq_stream.backends.heap import RESERVE_FROM, RESERVE_MIN, HeapAlloc
from tq_stream.backends.memory import MemoryUnit
from tq_stream.backends.slabs import MultiRaggedArena, RaggedArena
from tq_stream.columns import Ragged
from tq_stream.errors import MemoryBudgetExceeded
from tq_stream.multiragged import MultiRagged

pytestmark = pytest.mark.timeout(60)


def test_heap_extend_past_its_threshold_grows_in_place_and_keeps_rows():
    heap = HeapAlloc()
    t = heap.extend(heap((16,), torch.uint8), RESERVE_FROM, used=0)  # one put: the heap
    t[:16] = 7
    assert heap.extra_bytes(t, RESERVE_FROM + 1) == RESERVE_FROM + 1  # it will copy
    big = heap.extend(t, RESERVE_FROM + 1, used=16)  # moves once, into a reserved mapping
    assert big.shape == (RESERVE_FROM + 1,) and bool(big[:16].eq(7).all())
    view = big[:16]  # a reader's view of rows, as ``MultiRaggedArena.locate`` gives
    more = heap.extend(big, 2 * RESERVE_FROM, used=RESERVE_FROM)
    assert more.data_ptr() == big.data_ptr()  # no copy, no byte moved
    assert heap.extra_bytes(more, 3 * RESERVE_FROM) == RESERVE_FROM
    more[:16] = 9
    assert bool(view.eq(9).all())  # the old view sees the same memory


def test_heap_extend_past_the_reserved_room_copies_the_used_rows():
    heap = HeapAlloc()
    t = heap.extend(heap((4,), torch.float32), RESERVE_FROM, used=0)
    t = heap.extend(t, RESERVE_FROM + 1, used=0)  # reserved
    t[:3] = torch.tensor([1.0, 2.0, 3.0])
    far = RESERVE_MIN
    assert heap.extra_bytes(t, far) == far * 4  # held with the old one while copied
    grown = heap.extend(t, far, used=3)
    assert grown.shape == (far,) and grown[:3].tolist() == [1.0, 2.0, 3.0]


def _fill(arena, n: int, put) -> int:
    gen = torch.Generator().manual_seed(0)
    total = 0
    for i in range(n):
        total += put(arena, i, gen)
    return total


def test_a_ragged_arena_filled_put_by_put_holds_little_more_than_its_values():
    def put(arena: RaggedArena, i: int, gen: torch.Generator) -> int:
        rows = [torch.randint(0, 100, (int(torch.randint(100, 1000, (1,), generator=gen)),),
                              generator=gen) for _ in range(8)]
        arena.put(np.arange(8 * i, 8 * i + 8, dtype=np.int64), Ragged.from_list(rows))
        return sum(r.numel() for r in rows)

    arena = RaggedArena(torch.int64, ())
    values = _fill(arena, 64, put)
    held = arena.values.numel()
    assert values <= held <= values * (1 + 1 / STEP) + 16, (held, values)
    got = arena.get(np.array([0, 511], dtype=np.int64))
    assert got.offsets[-1] == arena.length[0] + arena.length[511]


def test_a_multi_ragged_arena_of_images_holds_little_more_than_its_pixels():
    def put(arena: MultiRaggedArena, i: int, gen: torch.Generator) -> int:
        h, w = (int(x) for x in torch.randint(100, 401, (2,), generator=gen))
        image = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=gen)
        arena.put(np.array([i], dtype=np.int64),
                  MultiRagged.from_list([image], fixed_dims=(0,)))
        return image.numel()

    arena = MultiRaggedArena(torch.uint8, (3, -1, -1))
    pixels = _fill(arena, 64, put)
    assert pixels <= arena.values.numel() <= pixels * (1 + 1 / STEP) + 16


def test_a_budget_counts_the_rows_a_growth_in_place_adds():
    """A partition whose arena fills most of its budget still grows by its new rows (an
    in-place growth holds no second copy), and is refused past the budget."""
    unit = MemoryUnit()
    budget = 8 * RESERVE_FROM
    unit.set_memory("p", memory_budget=budget)
    try:
        chunk = torch.ones(RESERVE_FROM, dtype=torch.uint8)
        for i in range(6):  # 6 MiB in an 8 MiB budget: a copy would need 12 at its peak
            unit.put("p", np.array([i], dtype=np.int64), {"x": Ragged.from_list([chunk])})
        assert unit.nbytes() <= budget
        with pytest.raises(MemoryBudgetExceeded):
            unit.put("p", np.array([9], dtype=np.int64),
                     {"x": Ragged.from_list([torch.ones(3 * RESERVE_FROM, dtype=torch.uint8)])})
        assert unit.get("p", np.array([5], dtype=np.int64), ["x"])["x"].values.sum() == \
            RESERVE_FROM
    finally:
        unit.close()
