"""A storage unit lost or replaced, as the ControllerService sees it (in process, its
units are fakes): the pid it reports for a restarted unit, and grants to a unit that
does not answer (bounded, skipped once it is known silent, undone when they fail).
The local-mode replays are in tests/integration/faults/test_model_unit_loss.py."""

from __future__ import annotations

import pytest

from tq_stream.backends.memory import MemoryUnit
from tq_stream.deploy.services import ControllerService, UnitService
from tq_stream.errors import StateError, Unreachable
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
