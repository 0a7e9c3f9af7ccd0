"""The controller's RPC surface without sockets: ``RemoteController`` (the client every
process uses) calls a ``ControllerService`` through its Dispatcher over
``InprocTransport``, whose storage unit is a ``UnitService`` reached the same way. The
allow-list, argument binding, admin authorization and reply shapes are the ones a
socket client meets (tests/integration/deploy/test_authorization.py has them over sockets)."""

from __future__ import annotations

import pytest
import torch

from tq_stream.backends.base import occupancy
from tq_stream.backends.memory import MemoryUnit
from tq_stream.columns import schema_of
from tq_stream.connection.proxies import RemoteController
from tq_stream.connection.remote_unit import RemoteUnit
from tq_stream.deploy.services import ControllerService, UnitService
from tq_stream.errors import AuthError, ConfigError
from tq_stream.transport import InprocTransport
from tq_stream.transport.dispatch import OWNER_ARG

pytestmark = pytest.mark.timeout(60)
P = "p"
TOKEN = "owner-" + "t" * 26
SCHEMA = {"x": schema_of(torch.zeros(1, 3)).to_dict()}


class Deployment:
    """A controller and one unit, each served in process through its allow-list."""

    def __init__(self) -> None:
        self.unit_rpc = InprocTransport(UnitService(MemoryUnit()), name="u0",
                                        owner_token=TOKEN)
        self.service = ControllerService(1, unit_client=lambda address: self.unit_rpc,
                                         unit_timeout=None, owner_token=TOKEN)
        self.rpc = InprocTransport(self.service, name="controller", owner_token=TOKEN)
        self.owner = self.client(TOKEN)
        self.owner.attach_units([{"address": "u0", "host": "", "pid": -1}])
        self.unit = RemoteUnit(self.unit_rpc, 5.0)

    def held(self) -> int:
        """Rows the unit holds in partition P (an admin call)."""
        held = self.unit_rpc.call("held", {OWNER_ARG: TOKEN})
        return len(held[P]["slots"]) if P in held else 0

    def client(self, token: str | None = None) -> RemoteController:
        return RemoteController(self.rpc, 5.0, owner_token=token)


def test_a_put_a_step_and_an_ack_through_the_clients_free_the_rows():
    d = Deployment()
    ctrl = d.client()  # a producer's or consumer's handle: no owner token
    ctrl.create_partition(P, consumers=["t"])
    ctrl.register_task(P, "t", ["x"], batch_size=2)
    place = ctrl.reserve(P, ["k0", "k1"], SCHEMA, timeout=5.0, session="s")
    tokens = occupancy(place.index, place.generation)
    d.unit.put(P, place.slot, {"x": torch.arange(6.0).view(2, 3)}, tokens)
    ctrl.commit(P, place.index, place.generation, SCHEMA)
    meta = ctrl.get_meta(P, "t", step=0, timeout=2.0, session="s")
    assert meta.keys == ["k0", "k1"] and not meta.end
    where = ctrl.locate(P, meta.keys)
    got = d.unit.get(P, where.slot, ["x"], occupancy(meta.index, meta.generation))
    assert torch.equal(got["x"], torch.arange(6.0).view(2, 3))
    assert d.held() == 2
    ctrl.ack(P, "t", meta.step, 0, meta.index, meta.generation, session="s")
    assert d.held() == 0
    assert ctrl.stats()[P]["rows"] == 0


def test_admin_calls_need_the_owner_token_and_the_rest_do_not():
    d = Deployment()
    assert [u.address for u in d.client().units()] == ["u0"]
    assert d.owner.state_dict()["partitions"] == {}
    with pytest.raises(AuthError, match="owner"):
        d.client().state_dict()  # refused by the client: it holds no token
    with pytest.raises(AuthError, match="wrong one"):
        d.client("not-the-owner-" + "x" * 20).state_dict()  # refused by the server
    with pytest.raises(AuthError, match="admin call"):
        d.unit.drop(P)  # a unit handle without the token


def test_only_the_service_s_rpc_methods_bind():
    d = Deployment()
    for method in ("_free_remote", "close", "missing"):
        with pytest.raises(ConfigError, match="method must be one of"):
            d.rpc.call(method, {})
    with pytest.raises(ConfigError, match="bad arguments for ControllerService.create_partition"):
        d.rpc.call("create_partition", {"partition": P, "colour": "red"})
    with pytest.raises(ConfigError, match="must not carry 'reply'"):
        d.rpc.call("get_meta", {"partition": P, "task": "t", "reply": "forged"})
