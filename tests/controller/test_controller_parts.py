"""The controller's seams: an injected clock, ``TaskConfig`` and ``register``, and the
free rows and slots a checkpoint carries (``PartitionMeta.free_state``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.conftest import FakeClock, dense_batch, keys_of
from tq_stream.controller import Controller
from tq_stream.controller.partition import PartitionMeta
from tq_stream.controller.task_config import TaskConfig
from tq_stream.convert import schemas_of
from tq_stream.errors import ConfigError

pytestmark = pytest.mark.timeout(60)
P = "train"


def _written(ctrl: Controller, keys: list[str]) -> None:
    schemas = schemas_of(dense_batch(keys))
    placed = ctrl.reserve(partition=P, keys=keys, schemas=schemas, timeout=5.0)
    ctrl.commit(partition=P, index=placed.index, generation=placed.generation,
                schemas=schemas)


def test_an_injected_clock_decides_when_a_lease_expires():
    clock = FakeClock()
    ctrl = Controller(clock=clock.time)
    ctrl.create_partition(P, consumers=["t"])
    ctrl.register_task(P, "t", ["x"], batch_size=2, lease_timeout=10.0)
    _written(ctrl, keys_of("k", 2))
    first = ctrl.get_meta(P, "t", step=0, timeout=5.0, session="a")
    assert first is not None and len(first.index) == 2
    clock.advance(9.0)  # still held by "a": another session waits for it, then is refused
    with pytest.raises(ConfigError, match="replica"):
        ctrl.get_meta(P, "t", step=0, timeout=0.05, session="b")
    clock.advance(2.0)  # "a" sent no heartbeat for longer than its lease: the share comes back
    again = ctrl.get_meta(P, "t", step=0, timeout=5.0, session="b")
    assert again is not None and sorted(again.index) == sorted(first.index)
    assert ctrl.stats()[P]["tasks"]["t"]["expired"] == 2  # rows whose lease expired


def test_task_config_checks_each_setting_and_round_trips_as_a_dict():
    config = TaskConfig.checked(["x", "y"], 4, dp_size=2, replicas=2, lease_timeout=30.0)
    assert config == TaskConfig(("x", "y"), 4, 2, 2, 30.0, False)
    assert TaskConfig.from_dict(config.to_dict()) == config
    for bad, name in (({"fields": []}, "fields"), ({"batch_size": 0}, "batch_size"),
                      ({"dp_size": -1}, "dp_size"), ({"replicas": 63}, "replicas"),
                      ({"lease_timeout": 0.0}, "lease_timeout")):
        settings = {"fields": ["x"], "batch_size": 1, **bad}
        with pytest.raises(ConfigError, match=name):
            TaskConfig.checked(**settings)


def test_register_with_a_config_is_register_task():
    ctrl = Controller()
    ctrl.register(P, "t", TaskConfig(("x",), 2))
    ctrl.register_task(P, "t", ["x"], batch_size=2)  # every rank: the same settings
    with pytest.raises(ConfigError, match="same settings"):
        ctrl.register_task(P, "t", ["x"], batch_size=3)


def test_free_rows_and_slots_survive_a_round_trip_with_spares_counted_free():
    part = PartitionMeta(P, None, 2)
    rows = part.allocate(keys_of("k", 4), np.array([0, 0, 1, 1], dtype=np.int32), 0.0)
    spare = part.allocate_spares(np.array([1], dtype=np.int32))
    for unit, slots in part.release(rows[:1]):  # freed in storage: reusable
        part.give_slots(unit, slots)
    state = part.free_state(spare)
    assert sorted(state["free_rows"]) == sorted([int(rows[0]), int(spare[0])])
    assert [p["free"] for p in state["pools"]] == [[int(part.slot[rows[0]])],
                                                    [int(part.slot[spare[0]])]]
    again = PartitionMeta(P, None, 2)
    again.grow_to(part.size)
    again.load_free_state(state)
    assert again.free_state(np.zeros(0, dtype=np.int64)) == state
