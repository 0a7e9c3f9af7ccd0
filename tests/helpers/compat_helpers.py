"""Builders shared by the compat tests: verl-shaped rows and byte-exact comparisons."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

import torch
from tensordict import NonTensorStack, TensorDict

EMBEDDED = {"tq_stream": {"mode": "embedded"}}  # even when the session has Ray up
VERL_CONF = {
    "enable": True,
    **EMBEDDED,
    "metrics": {"enabled": False, "port": 0},
    "backend": {"storage_backend": "SimpleStorage",
                "SimpleStorage": {"total_storage_size": 100000, "num_data_storage_units": 2}},
}


def prompt_tags(n: int, step: int) -> list[dict[str, Any]]:
    return [{"is_prompt": True, "status": "pending", "global_steps": step} for _ in range(n)]


def trajectory(uid: str, session: int, step: int, seed: int) -> tuple[dict, dict]:
    """One agent-loop output as verl's AgentLoopWorkerTQ builds it: (fields, tag)."""
    g = torch.Generator().manual_seed(seed)
    p_len, r_len = 3 + seed % 5, 2 + seed % 7
    prompts = torch.randint(0, 1000, (p_len,), generator=g)
    responses = torch.randint(0, 1000, (r_len,), generator=g)
    fields = {
        "prompts": prompts, "responses": responses,
        "response_mask": torch.ones(r_len, dtype=torch.int64),
        "loss_mask": torch.ones(r_len, dtype=torch.int64),
        "input_ids": torch.cat([prompts, responses]),
        "position_ids": torch.arange(p_len + r_len),
        "rollout_log_probs": torch.randn(r_len, generator=g),
        "rm_scores": torch.zeros(r_len).index_fill_(0, torch.tensor([r_len - 1]), float(seed % 2)),
        "num_turns": 2,
        "metrics": {"generate_sequences": 0.5 + seed},
        "extra_fields": {"reward_extra_info": {"acc": float(seed % 2)},
                         "min_global_steps": step, "max_global_steps": step},
        "raw_prompt": [{"role": "user", "content": f"question {uid}"}],
        "data_source": "gsm8k", "reward_model": {"ground_truth": str(seed)},
        "index": seed, "uid": uid, "global_steps": step, "agent_name": "single_turn_agent",
        "session_id": session, "multi_modal_inputs": {},
    }
    tag = {"status": "success", "prompt_len": p_len, "response_len": r_len,
           "seq_len": p_len + r_len, "global_steps": step, "min_global_steps": step,
           "max_global_steps": step}
    return fields, tag


def list_of_dict_to_tensordict(rows: list[dict[str, Any]]) -> TensorDict:
    """verl's ``tensordict_utils.list_of_dict_to_tensordict`` (same layout rules)."""
    out: dict[str, Any] = {}
    for key in rows[0]:
        vals = [r[key] for r in rows]
        if all(isinstance(v, torch.Tensor) for v in vals):
            if all(v.shape == vals[0].shape for v in vals):
                out[key] = torch.stack(vals)
            else:
                out[key] = torch.nested.as_nested_tensor(vals, layout=torch.jagged)
        else:
            out[key] = NonTensorStack(*vals)
    return TensorDict(out, batch_size=[len(rows)])


def new_uid() -> str:
    return uuid.uuid4().hex


def assert_rows_equal(got: TensorDict, rows: list[dict[str, Any]]) -> None:
    """``got`` holds exactly ``rows`` in order: tensors byte-exact with their dtype,
    ragged ones as jagged nested tensors; other values equal with equal types."""
    assert got.batch_size[0] == len(rows)
    for key in rows[0]:
        value = got[key]
        want = [r[key] for r in rows]
        if isinstance(want[0], torch.Tensor):
            if want[0].dim() == 0:
                assert torch.equal(value, torch.stack(want)), key
                continue
            assert value.is_nested and value.layout == torch.jagged, key
            parts = value.unbind()
            assert len(parts) == len(want)
            for a, b in zip(parts, want, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, key
                assert a.contiguous().view(torch.uint8).tolist() == \
                    b.contiguous().view(torch.uint8).tolist(), key
            lengths = [w.shape[0] for w in want]
            assert value.offsets().diff().tolist() == lengths, key
        else:
            listed = value.tolist()
            assert listed == want, key
            assert [type(v) for v in listed] == [type(v) for v in want], key


def dashboard_metrics() -> set[str]:
    """The metric names the Grafana dashboard (docs/grafana) plots."""
    import json
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).parent.parent.parent / "docs/grafana/tq_stream.json")
                      .read_text())
    return {m for p in dash["panels"] for t in p["targets"]
            for m in re.findall(r"tq_stream_\w+", t["expr"])}


def scrape_metric_names(endpoint: str) -> set[str]:
    """The metric names ``http://<endpoint>/metrics`` exports, as a dashboard queries
    them (a counter with ``_total``, a histogram with ``_bucket``, ``_sum``, ``_count``)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as r:
        text = r.read().decode()
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
    return {fam.name + s for fam in text_string_to_metric_families(text)
            for s in suffixes.get(fam.type, [""])}


def in_process(target: Any, *args: Any, method: str = "spawn", timeout: float = 120.0) -> Any:
    """Run ``target(queue, *args)`` in another process (``method``: spawn or fork) and
    return the one value it puts on ``queue`` (errors travel back as values)."""
    import multiprocessing as mp

    ctx = mp.get_context(method)
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(queue, *args))
    proc.start()
    try:
        return queue.get(timeout=timeout)
    finally:
        proc.join(timeout=30)


@contextlib.contextmanager
def installed_module() -> Iterator[Any]:
    """``import transfer_queue`` after ``install()``, closed and uninstalled after (the
    body of the ``tq`` fixtures)."""
    import tq_stream.compat

    tq_stream.compat.install()
    import transfer_queue

    try:
        yield transfer_queue
    finally:
        transfer_queue.close()
        tq_stream.compat.uninstall()
