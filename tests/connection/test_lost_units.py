"""LostUnits (issue 20 item 11): a unit call that waits stops once the controller
declared its unit lost or serves it elsewhere; the Ray replay is in
tests/integration/faults/test_ray_node_loss.py."""

from __future__ import annotations

import pytest

from tq_stream.connection.lost_units import LostUnits
from tq_stream.errors import ConnectionLost, DeploymentGone, WaitTimeout
from tq_stream.messages.admin import Ping, UnitAddress

UNITS = [UnitAddress(address="tcp://a:1", host="a"),
         UnitAddress(address="tcp://b:2", host="b", local="unix://b")]


class Controller:
    """What the controller says of its units (``ping`` and ``units``)."""

    def __init__(self) -> None:
        self.dead: list[int] = []
        self.units = list(UNITS)
        self.epoch = 1
        self.pings = 0
        self.slow = False

    def ping(self, timeout: float) -> Ping:
        self.pings += 1
        if self.slow:
            raise WaitTimeout(f"no reply to 'ping' within {timeout} s")
        return Ping(pid=1, host="h", units=len(self.units), dead_units=list(self.dead),
                    units_epoch=self.epoch)

    def listing(self) -> list[UnitAddress]:
        return self.units


def watch(ctrl: Controller, check_owner=lambda: None, interval: float = 0.0) -> LostUnits:
    """interval 0: every check asks the controller."""
    return LostUnits(ctrl.ping, ctrl.listing, check_owner, interval)


def test_a_live_unit_at_its_address_goes_on_waiting():
    ctrl = Controller()
    lost = watch(ctrl)
    lost.check(0, "tcp://a:1")
    lost.check(1, "unix://b")  # its local address is its address too


def test_a_unit_the_controller_declared_lost_ends_the_call():
    ctrl = Controller()
    lost = watch(ctrl)
    lost.check(1, "tcp://b:2")
    ctrl.dead = [1]
    with pytest.raises(ConnectionLost, match="storage unit 1 at tcp://b:2 .* declared it lost"):
        lost.check(1, "tcp://b:2")
    lost.check(0, "tcp://a:1")  # the other unit is not concerned


def test_a_unit_re_created_elsewhere_ends_a_call_to_its_old_address():
    ctrl = Controller()
    lost = watch(ctrl)
    lost.check(1, "tcp://b:2")
    ctrl.units[1] = UnitAddress(address="tcp://c:3", host="c")
    ctrl.epoch = 2
    with pytest.raises(ConnectionLost, match="re-created at tcp://c:3"):
        lost.check(1, "tcp://b:2")
    lost.check(1, "tcp://c:3")


def test_a_silent_controller_is_no_news_and_pings_are_shared():
    ctrl = Controller()
    lost = watch(ctrl, interval=60.0)
    for unit, address in ((0, "tcp://a:1"), (1, "tcp://b:2"), (1, "tcp://b:2")):
        lost.check(unit, address)
    assert ctrl.pings == 1  # one ping per interval for every waiting call
    ctrl.slow, ctrl.dead = True, [1]
    lost = watch(ctrl)
    lost.check(1, "tcp://b:2")  # no answer: the call waits on


def test_a_gone_deployment_is_told_first():
    def gone() -> None:
        raise DeploymentGone("the tq_stream deployment at tcp://x:1 is gone")

    with pytest.raises(DeploymentGone):
        watch(Controller(), gone).check(0, "tcp://a:1")
