"""A storage unit lost or replaced, as the ControllerService sees it (in process, its
units are fakes): the pid it reports for a restarted unit, grants to a unit that
does not answer (bounded, skipped once it is known silent, undone when they fail),
and a put meant for a dead unit that reaches the one replacing it at its address.
The local-mode replays are in tests/integration/faults/test_model_unit_loss.py and
test_lost_between_puts.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tq_stream.backends.base import occupancy
from tq_stream.backends.memory import MemoryUnit
from tq_stream.deploy.services import ControllerService, UnitService
from tq_stream.errors import StateError, Unreachable
from tq_stream.messages.puts import Placement
from tq_stream.transport import InprocTransport

P = "p"
SCHEMA = {"x": {"kind": "dense", "dtype": "float32", "shape": []}}
UNITS = [{"address": f"u{i}", "host": "", "pid": 10 + i} for i in range(2)]


TOKEN = "owner-" + "t" * 26


class Unit(InprocTransport):
    """A unit served in process, called through its allow-list; ``down`` makes every
    call fail as a dead unit's does."""

    def __init__(self, address: str) -> None:
        super().__init__(UnitService(MemoryUnit()), name=address, owner_token=TOKEN)
        self.down = False
        self.calls: list[tuple[str, float | None]] = []

    def restart(self) -> None:
        """A new, empty unit process serves at this address."""
        super().__init__(UnitService(MemoryUnit()), name=self.address, owner_token=TOKEN)

    def call(self, method, args=None, timeout=None):
        self.calls.append((method, timeout))
        if self.down:
            raise Unreachable(f"no server at this unit for {method!r} (ConnectionRefused)")
        return super().call(method, args, timeout)


def _controller() -> tuple[ControllerService, list[Unit]]:
    units = [Unit(u["address"]) for u in UNITS]
    by_address = {u.address: u for u in units}
    ctrl = ControllerService(2, unit_client=lambda address: by_address[address],
                             unit_timeout=None, owner_token=TOKEN)
    ctrl.attach_units([dict(u) for u in UNITS])
    return ctrl, units


def test_the_pid_of_a_restarted_unit_is_the_new_process_when_the_watch_saw_it_first():
    """restart_unit: the unit watch pings the new process (``unit_answered``) before
    the owner's ``drop_unit`` names it: ``units()`` (so ``Stream.processes()``) named
    the killed process ever after."""
    ctrl, _ = _controller()
    ctrl.unit_lost(1)  # the watch declared the killed process lost
    ctrl.unit_answered(1, 21)  # and heard the new one, before the owner's call
    assert ctrl.drop_unit(1, {"address": "u1", "host": "", "pid": 21}) == {}
    assert [u["pid"] for u in ctrl.units()] == [10, 21]
    ctrl.unit_answered(0, 30)  # a unit replaced behind the owner's back: named too
    assert [u["pid"] for u in ctrl.units()] == [30, 21]


def _put(ctrl: ControllerService, partition: str, keys: list[str]) -> dict:
    place = ctrl.reserve(partition, keys, SCHEMA, session="s")
    ctrl.commit(partition, place.index, place.generation, SCHEMA)
    return place


def test_a_grant_a_dead_unit_does_not_take_is_bounded_undone_and_placed_elsewhere():
    """Unit 1 died and is not declared lost yet: a put needing a grant there waited the
    controller's whole call timeout, then failed with its rows left reserved (held
    until the producer's lease ran out); now the grant waits 5 s at most, the rows
    are taken back and placed on the unit that answers."""
    ctrl, units = _controller()
    units[1].down = True
    place = _put(ctrl, P, [f"k{i}" for i in range(8)])
    assert place.unit.tolist() == [0] * 8
    grants = [t for m, t in units[1].calls if m == "grant"]
    assert grants and all(t is not None and t <= 5.0 for t in grants)
    assert ctrl.stats()[P]["rows"] == 8 and len(ctrl.list_rows(P)) == 8
    before = len(units[1].calls)
    assert _put(ctrl, "q", ["a", "b"]).unit.tolist() == [0, 0]  # known silent:
    assert len(units[1].calls) == before  # not called again
    units[1].down = False
    ctrl.unit_answered(1, 11)  # the watch hears it again: rows go there again
    assert 1 in _put(ctrl, "r", ["a", "b"]).unit.tolist()


def test_a_put_fails_once_every_unit_refuses_its_grant_and_leaves_nothing():
    ctrl, units = _controller()
    for u in units:
        u.down = True
    with pytest.raises(StateError, match="storage unit 1 did not take a grant"):
        ctrl.reserve(P, ["a", "b"], SCHEMA, session="s")
    assert ctrl.stats().get(P, {}).get("rows", 0) == 0


def _store(unit: Unit, place: Placement, rows: np.ndarray, value: float) -> None:
    """The bytes of ``rows`` (positions in ``place``) to ``unit``, as a writer sends them."""
    unit.call("put", {"partition": P, "slots": place.slot[rows],
                      "columns": {"x": torch.full((len(rows),), value)},
                      "generations": occupancy(place.index[rows], place.generation[rows])})


def test_a_put_meant_for_a_replaced_unit_never_overwrites_rows_placed_on_its_successor():
    """A unit client retries a refused connection for ``UNIT_CONNECT_WINDOW`` seconds,
    and a local unit restarts at its address within it: a put to a unit that died,
    of rows placed before it was declared lost, reached the new unit after the
    controller had placed other rows in those very slots, and overwrote them. Those
    rows then held another row's values (silently), or another row's token: every
    read failed ("slots [4..7] were cleared since metadata was read") while the
    controller handed them out again and again."""
    ctrl, units = _controller()
    old = ctrl.reserve(P, [f"a{i}" for i in range(8)], SCHEMA, session="s")
    late = np.flatnonzero(old.unit == 1)  # their bytes are on their way to unit 1
    ctrl.unit_lost(1)  # unit 1 died: the rows placed there are undone
    units[1].restart()  # and a new process serves at its address
    ctrl.drop_unit(1, {"address": "u1", "host": "", "pid": 21})
    new = ctrl.reserve(P, [f"b{i}" for i in range(8)], SCHEMA, session="s")
    mine = np.flatnonzero(new.unit == 1)
    assert len(late) and set(new.slot[mine]) >= set(old.slot[late])  # reused
    for u in (0, 1):
        _store(units[u], new, np.flatnonzero(new.unit == u), 2.0)
    ctrl.commit(P, new.index, new.generation, SCHEMA)

    with pytest.raises(StateError, match="hold other rows"):  # the dead unit's put, late
        _store(units[1], old, late, 1.0)

    got = units[1].call("get", {"partition": P, "slots": new.slot[mine], "fields": ["x"],
                                "generations": occupancy(new.index[mine],
                                                         new.generation[mine])})
    assert got["x"].tolist() == [2.0] * len(mine)
    with pytest.raises(StateError):  # the late put's own rows are gone: it puts again
        ctrl.commit(P, old.index, old.generation, SCHEMA)
