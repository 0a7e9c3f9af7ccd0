"""A field written with different types by different puts (``compat/variants.py``), with
the writer and the reader in two processes (local mode): a read never returns a value
older than the row's last write; where it cannot tell which write is the last, it
fails loudly (issue 21)."""

from __future__ import annotations

import pytest
import torch
from tensordict import NonTensorStack, TensorDict

import tq_stream.compat
from tests.helpers.compat_helpers import in_process, installed_module
from tq_stream.errors import SchemaError, StateError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

LOCAL = {"tq_stream": {"mode": "local", "timeout": 10.0}}


def tensor_rows(*values: int) -> TensorDict:
    return TensorDict({"x": torch.tensor(list(values))}, batch_size=[len(values)])


def object_rows(*values: object) -> TensorDict:
    return TensorDict({"x": NonTensorStack(*values)}, batch_size=[len(values)])


def _rewrite(queue, key: str, as_object: bool) -> None:
    """Another process: rewrite ``key``'s field ``x`` with the other type, read it back."""
    tq_stream.compat.install()
    import transfer_queue as tq

    try:
        tq.init()
        fields = object_rows("new") if as_object else tensor_rows(99)
        tq.kv_batch_put(keys=[key], partition_id="p", fields=fields)
        queue.put(("put", tq.kv_batch_get(keys=[key], partition_id="p",
                                          select_fields=["x"])["x"].tolist()))
    except Exception as exc:  # the error travels back as a value
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


@pytest.fixture
def tq():
    with installed_module() as module:
        module.init(LOCAL)
        yield module


def test_rewriting_a_row_s_tensor_field_with_python_values_is_refused(tq):
    """The other process would store ``x@object`` beside the row's ``x``: this process,
    which never saw ``x@object``, would read the old tensor from ``x``."""
    tq.kv_batch_put(keys=["j", "k"], partition_id="p", fields=tensor_rows(5, 6))
    status, got = in_process(_rewrite, "k", True)
    assert status == "error" and got.startswith("SchemaError"), (status, got)
    assert "'x'" in got and "'k'" in got and "kv_clear" in got, got
    assert tq.kv_batch_get(keys=["k"], partition_id="p")["x"].tolist() == [6]  # as written
    tq.kv_clear(keys=["k"], partition_id="p")  # the way out the error names
    tq.kv_batch_put(keys=["k"], partition_id="p", fields=object_rows("new"))
    assert tq.kv_batch_get(keys=["k", "j"], partition_id="p")["x"].tolist()[0] == "new"


def test_rewriting_python_values_with_a_tensor_is_read_as_written_or_loudly(tq):
    """The other process never saw ``x@object`` and writes ``x`` (the first type) to a
    row that holds ``x@object``: it reads its own write back; here, where both are
    known, a read of that row fails loudly, alone or beside rows of one type."""
    tq.kv_batch_put(keys=["j"], partition_id="p", fields=tensor_rows(1))
    tq.kv_batch_put(keys=["k", "m"], partition_id="p", fields=object_rows("s", "t"))
    status, got = in_process(_rewrite, "k", False)
    assert (status, got) == ("put", [99])
    for keys in (["k"], ["k", "m"], ["m", "k"], ["j", "k"]):
        with pytest.raises(StateError, match="'k'"):
            tq.kv_batch_get(keys=keys, partition_id="p", select_fields=["x"])
    assert tq.kv_batch_get(keys=["m"], partition_id="p")["x"].tolist() == ["t"]
    with pytest.raises(SchemaError, match="kv_clear"):  # x@object again: refused here too
        tq.kv_batch_put(keys=["k"], partition_id="p", fields=object_rows("u"))
