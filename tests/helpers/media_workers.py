"""Code that spawned children of the media-by-reference tests run (kept apart from
the test modules, so a child imports only this and tq_stream)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection

import torch

import tq_stream as tq
from tests.helpers.shm_maps import in_shm


def image_data(img: torch.Tensor) -> dict:
    return {"image": tq.MultiRagged.from_list([img], fixed_dims=(0,)),
            "prompt": torch.tensor([1, 2, 3])}


def resolve(ref: tq.MediaRef, out: Connection) -> None:
    """Join the deployment of ``ref``, resolve it three times, send the image, the
    data pointers of the reads (equal ones: views of the unit's shared memory) and
    whether each read lies in a unit's shared-memory segment."""
    stream = tq.connect(ref.address, curve_server_key=ref.curve_server_key)
    try:
        reads = [stream.resolve(ref)["image"] for _ in range(3)]
        img = reads[-1]  # plain values: a tensor sent would outlive its sender's memory
        out.send({"image": (img.numpy().tobytes(), tuple(img.shape)),
                  "ptrs": [r.data_ptr() for r in reads], "shm": [in_shm(r) for r in reads]})
    finally:
        stream.close()


def put_and_hang(address: str, partition: str, img: torch.Tensor, lease: float,
                 out: Connection) -> None:
    """Put media with a short lease, send its handle, then wait to be killed."""
    stream = tq.connect(address, lease_timeout=lease)
    out.send(stream.media.put(partition, "doomed", image_data(img)))
    time.sleep(300)
