"""The controller's side of write→wake for one row: ``commit_new``, ``get_meta``, ``ack``.

One task reads one row per step (the default sampler, ``batch_size=1``); each round
commits one new row on a spare row, takes its step and acks it. Two ways, in one
process (no sockets, no threads, so the figures move only with the controller's code):

- ``direct``: the Controller's methods called as the embedded mode calls them;
- ``server``: as a local-mode server worker runs a request between reading it and
  sending the reply: decode the request frames, dispatch, encode the reply.

Each ``warm`` (back to back) and ``cold`` (the process idle ``--idle-ms`` before each
round: this machine then runs Python several times slower, and a waiting consumer is
woken after such an idle). Prints a markdown table of p50 latencies in ms. Run from the
repository root: ``python -m benchmarks.bench_controller_calls [--rounds 300]``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import torch

from tq_stream.columns import schema_of
from tq_stream.controller import Controller
from tq_stream.messages import puts, reads
from tq_stream.messages.rpc import RpcTable
from tq_stream.serialization import decode, encode
from tq_stream.transport.dispatch import Dispatcher
from tq_stream.transport.replies import INLINE_BYTES, read_request, run_request

CALLS = ("commit_new", "get_meta", "ack")
Call = Callable[..., tuple[Any, float]]  # (method, **args) -> (result, seconds)


def _plain(value: Any) -> Any:
    """A typed reply as the dict its wire form decodes to (arrays kept)."""
    if isinstance(value, msgspec.Struct):
        return {f: _plain(getattr(value, f)) for f in value.__struct_fields__
                if getattr(value, f) is not None}
    return value


def direct(ctrl: Controller) -> Call:
    def call(method: str, **args: Any) -> tuple[Any, float]:
        t0 = time.perf_counter()
        out = getattr(ctrl, method)(**args)
        seconds = time.perf_counter() - t0
        return _plain(out), seconds
    return call


class _Served:
    """``ctrl``'s puts and reads behind their RPC table (no storage units to serve)."""

    RPC_TABLE = RpcTable(puts.RPCS, reads.RPCS)

    def __init__(self, ctrl: Controller) -> None:
        for name in self.RPC_TABLE.methods:
            setattr(self, name, getattr(ctrl, name))


def server(ctrl: Controller) -> Call:
    dispatch, ids = Dispatcher(_Served(ctrl)), iter(range(1, 1 << 62))

    def call(method: str, **args: Any) -> tuple[Any, float]:
        frames = [bytes(f) for f in encode({"id": next(ids), "method": method, "args": args,
                                            "timeout": 5.0}, inline=INLINE_BYTES)]
        t0 = time.perf_counter()
        request, error = read_request(frames, "bench")
        assert request is not None, error
        reply = run_request(dispatch, request, time.monotonic(), False, "bench")
        seconds = time.perf_counter() - t0
        out = decode([bytes(f) for f in reply])
        assert out["ok"], out
        return out["result"], seconds
    return call


def bench(make: Callable[[Controller], Call], rounds: int, idle_s: float) -> dict[str, dict]:
    """p50 ms of each call, warm and cold."""
    ctrl = Controller(2)
    ctrl.create_partition("p", consumers=["t"])
    ctrl.register_task("p", "t", ["x"], batch_size=1)
    schemas = {"x": schema_of(torch.zeros(1, 4)).to_dict()}
    call = make(ctrl)
    spares: list[tuple[np.ndarray, np.ndarray]] = []
    step = 0

    def one_round(times: dict[str, list[float]]) -> None:
        nonlocal step
        index, gen = spares.pop()
        out, t1 = call("commit_new", partition="p", keys=[f"k{step}"], index=index,
                       generation=gen, schemas=schemas, spare=16 if len(spares) < 8 else 0)
        if out.get("spare") is not None:
            sp = out["spare"]
            spares.extend((sp["index"][i:i + 1], sp["generation"][i:i + 1])
                          for i in range(len(sp["index"])))
        meta, t2 = call("get_meta", partition="p", task="t", step=step, timeout=5.0)
        _, t3 = call("ack", partition="p", task="t", step=step, dp_rank=0,
                     index=meta.index, generation=meta.generation)
        for name, t in zip(CALLS, (t1, t2, t3), strict=True):
            times[name].append(t)
        step += 1

    placed = ctrl.reserve(partition="p", keys=[], schemas=schemas, spare=16, timeout=5).spare
    assert placed is not None
    spares.extend((placed.index[i:i + 1], placed.generation[i:i + 1])
                  for i in range(len(placed.index)))
    out: dict[str, dict] = {}
    for phase, idle in (("warmup", 0.0), ("warm", 0.0), ("cold", idle_s)):
        times: dict[str, list[float]] = {name: [] for name in CALLS}
        for _ in range(rounds):
            if idle:
                time.sleep(idle)
            one_round(times)
        out[phase] = {name: float(np.median(v)) * 1e3 for name, v in times.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--idle-ms", type=float, default=5.0)
    args = parser.parse_args()
    print("| path | state | " + " | ".join(f"{c} p50 ms" for c in CALLS) + " |")
    print("|---|---|" + "---:|" * len(CALLS))
    for name, make in (("direct", direct), ("server", server)):
        res = bench(make, args.rounds, args.idle_ms / 1e3)
        for state in ("warm", "cold"):
            cells = " | ".join(f"{res[state][c]:.3f}" for c in CALLS)
            print(f"| {name} | {state} | {cells} |")


if __name__ == "__main__":
    main()
