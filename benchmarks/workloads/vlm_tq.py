"""tq_stream's ends of workload ``vlm``: one producer, one trainer, three layouts.

- ``copied`` (a): every response row carries its group's image (a multi-ragged field)
  and prompt tokens, i.e. ``responses`` copies of each.
- ``side`` (b): the image and prompt tokens are written once, on a side partition keyed
  by the prompt uid; the trainer reads the uids of a batch from there and joins.
- ``shared`` (c): shared fields (issue 23, item 2): the image and prompt tokens written
  once under the prompt uid (``Writer.put_shared``), each response row naming it.

Every group is two puts, the rollouts then the rewards (the group's last field, as a
reward model writes it later); the write time of a row is the start of that last put.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from benchmarks.workloads.vlm_data import Group, Shape, image_shapes, uid_of

LAYOUTS = ("copied", "side", "shared")
PARTITION, SIDE, TASK = "vlm", "vlm-prompts", "train"
ROW_FIELDS = ["response_ids", "logprobs", "reward"]
PROMPT_FIELDS = ["image", "prompt_ids"]


def jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def put_shared(writer: Any, grp: Group, rows: dict[str, Any]) -> None:
    """Layout (c): the group's prompt fields written once under its uid
    (``Writer.put_shared``), then its response rows naming that entry (``put(...,
    shared=)``), which read the entry's fields as their own."""
    import tq_stream as tq

    writer.put_shared([grp.uid], {
        "image": tq.MultiRagged.from_list([grp.image], fixed_dims=(0,)),
        "prompt_ids": jagged([grp.prompt_ids])})
    writer.put(grp.keys, rows, shared=[grp.uid] * len(grp.keys))


class Producer:
    """Writes groups into a started tq_stream deployment (picklable unless embedded)."""

    def __init__(self, stream: Any, layout: str, own: bool) -> None:
        self.stream, self.layout, self.own = stream, layout, own
        self._rows: Any = None
        self._side: Any = None

    def open(self) -> None:
        self._rows = self.stream.writer(PARTITION)
        self._side = self.stream.writer(SIDE) if self.layout == "side" else None

    def put_group(self, grp: Group) -> float:
        """Write one group; returns when its last put started (time.monotonic)."""
        import tq_stream as tq

        keys, n = grp.keys, len(grp.keys)
        rows: dict[str, Any] = {"response_ids": jagged(grp.response_ids),
                                "logprobs": jagged(grp.logprobs)}
        if self.layout == "copied":
            rows["image"] = tq.MultiRagged.from_list([grp.image] * n, fixed_dims=(0,))
            rows["prompt_ids"] = jagged([grp.prompt_ids] * n)
        elif self.layout == "side":
            self._side.put([grp.uid], {
                "image": tq.MultiRagged.from_list([grp.image], fixed_dims=(0,)),
                "prompt_ids": jagged([grp.prompt_ids])})
        if self.layout == "shared":
            put_shared(self._rows, grp, rows)
        else:
            self._rows.put(keys, rows)
        t = time.monotonic()
        self._rows.put(keys, {"reward": grp.rewards})
        return t

    def close(self) -> None:
        if self.own:
            self.stream.close()


class Consumer:
    """The trainer: a StreamingDataLoader over the response rows, one group a batch,
    checking each image's shape (and, for ``side``, joining the prompt fields)."""

    def __init__(self, stream: Any, layout: str, shape: Shape, own: bool,
                 timeout: float) -> None:
        self.stream, self.layout, self.shape, self.own = stream, layout, shape, own
        self.timeout = timeout
        self._loader: Any = None
        self._shapes: dict[str, tuple[int, ...]] = {}

    def open(self) -> None:
        import tq_stream as tq

        self._shapes = image_shapes(self.shape)
        fields = ROW_FIELDS + (PROMPT_FIELDS if self.layout != "side" else [])
        ds = tq.StreamingDataset(self.stream, PARTITION, TASK, fields,
                                 batch_size=self.shape.responses, ragged="list",
                                 timeout=self.timeout)
        self._loader = tq.StreamingDataLoader(ds, num_workers=0)

    def batches(self) -> Iterator[tuple[list[str], float]]:
        import tq_stream as tq

        for batch in self._loader:
            keys = list(tq.batch_meta(batch).keys)
            uids = [uid_of(k) for k in keys]
            if self.layout == "side":  # the join: each distinct prompt read once
                distinct = list(dict.fromkeys(uids))
                prompts = self.stream.kv.get_batch(distinct, PROMPT_FIELDS, partition=SIDE,
                                                   ragged="list")
                by_uid = dict(zip(distinct, prompts.get("image").tolist(), strict=True))
                images = [by_uid[u] for u in uids]
            else:
                images = batch.get("image").tolist()
            t = time.monotonic()
            check(images, uids, self._shapes)
            yield keys, t

    def close(self) -> None:
        self._loader = None
        if self.own:
            self.stream.close()


def check(images: list[torch.Tensor], uids: list[str],
          shapes: dict[str, tuple[int, ...]]) -> None:
    """Every row read the image of its own group."""
    for img, uid in zip(images, uids, strict=True):
        if tuple(img.shape) != shapes[uid] or img.dtype != torch.uint8:
            raise AssertionError(f"row of {uid} read an image {tuple(img.shape)} "
                                 f"{img.dtype}, wrote {shapes[uid]} uint8")


class TqTarget:
    """One tq_stream deployment for one layout."""

    def __init__(self, mode: str, layout: str) -> None:
        self.mode, self.layout = mode, layout
        self.name = f"tq-{mode}"
        self.in_process = mode == "embedded"
        self.stream: Any = None

    def start(self) -> None:
        import tq_stream as tq

        self.stream = tq.init() if self.mode == "embedded" else \
            tq.init(mode=self.mode, storage_units=2)
        # no consumers declared: rows stay until cleared, so the storage held once
        # the trainer has read everything is every row's
        self.stream.create_partition(PARTITION)
        if self.layout == "side":
            self.stream.create_partition(SIDE)

    def roles(self) -> dict[str, list[int]]:
        """The deployment's server processes by role (embedded: none of its own)."""
        if self.in_process:
            return {}
        return {("controller" if p.role == "controller" else f"unit {p.index}"): [p.pid]
                for p in self.stream.processes()}

    def producer(self) -> Producer:
        return Producer(self.stream, self.layout, own=not self.in_process)

    def consumer(self, shape: Shape, timeout: float) -> Consumer:
        return Consumer(self.stream, self.layout, shape, not self.in_process, timeout)

    def storage_bytes(self, sampler: object) -> int:
        """Bytes the storage units hold for row data (their allocated capacity)."""
        stats = self.stream.deployment_stats()
        return sum(u["nbytes"] for u in stats["units"] if u["up"])

    def stop(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
