"""put_shared made again: the same values in another Python form are a no-op, other
values are refused; a put that can never fit beside the shared entries fails at once."""

from __future__ import annotations

import pytest
import torch

import tq_stream as tq
from tq_stream.errors import ConfigError

IMG = torch.arange(3 * 5 * 7, dtype=torch.int64).reshape(3, 5, 7).to(torch.uint8)


@pytest.mark.parametrize("first", ["multiragged", "tensor", "list"])
def test_the_same_pixels_in_another_form_are_a_retry(first):
    forms = {
        "multiragged": lambda: ("u0", {"image": tq.MultiRagged.from_list([IMG], fixed_dims=(0,))}),
        "list": lambda: (["u0"], {"image": [IMG]}),
        "tensor": lambda: ("u0", {"image": IMG}),
        "dense": lambda: (["u0"], {"image": IMG[None]}),
    }
    with tq.init() as stream:
        w = stream.writer("e")
        assert w.put_shared(*forms[first]()) == ["u0"]
        for name, form in forms.items():
            assert w.put_shared(*form()) == [], name  # stored already: nothing written
        with pytest.raises(ConfigError, match="'image' holds other bytes.*dtype, shape"):
            w.put_shared("u0", {"image": IMG.to(torch.int16)})  # same numbers, other dtype
        with pytest.raises(ConfigError, match="'image' holds other bytes"):
            w.put_shared("u0", {"image": IMG.reshape(3, 7, 5)})  # same bytes, other shape
        w.put(["r"], {"y": torch.ones(1, 1)}, shared=["u0"])
        assert torch.equal(stream.kv.get("r", partition="e")["image"], IMG)


def test_rows_that_cannot_fit_beside_the_entries_they_need_fail_at_once():
    with tq.init() as stream:
        stream.create_partition("cap", capacity=8, consumers=["a"])
        w = stream.writer("cap")
        w.put_shared("g", {"prompt": torch.arange(4)})
        with pytest.raises(ConfigError, match=r"capacity 8 .*1 slot.*shared entr.*got 8 new"):
            w.put([f"g_{j}" for j in range(8)], {"response": torch.ones(8, 2)},
                  shared=["g"] * 8, timeout=60)
        assert stream.stats()["cap"]["rows"] == 0  # nothing stored
        w.put([f"g_{j}" for j in range(7)], {"response": torch.ones(7, 2)},
              shared=["g"] * 7)  # 7 rows and their entry fit
        assert stream.stats()["cap"]["rows"] == 7
