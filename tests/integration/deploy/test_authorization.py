"""Admin calls are the owner's (local mode): a connected client that is not the owner
gets AuthError from each of them and changes nothing; the owner's calls still work."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

import tq_stream as tq
from tests.helpers.tq_fixtures import start_local
from tests.helpers.tq_workers import values
from tq_stream.errors import AuthError, ConfigError, StateError
from tq_stream.transport.dispatch import OWNER_ARG
from tq_stream.transport.handler import Methods
from tq_stream.transport.rpc import rpc_client
from tq_stream.transport.zeromq import RpcServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

ADMIN_CALLS = {  # method -> arguments a non-owner might send
    "attach_units": {"units": [{"address": "tcp://127.0.0.1:1", "host": "x", "pid": 1}]},
    "drop_unit": {"unit": 0},
    "state_dict": {},
    "load_state_dict": {"state": {}},
    "clear_partition": {"partition": "auth"},
}


@pytest.fixture(scope="module", params=["unix", "tcp"])
def owner(request):
    stream = start_local(storage_units=1, transport=request.param)
    try:
        yield stream
    finally:
        stream.close()


def _rows(stream: tq.Stream, keys: list[str]) -> torch.Tensor:
    return stream.kv.get_batch(keys, partition="auth")["x"]


@pytest.mark.parametrize("method", sorted(ADMIN_CALLS))
@pytest.mark.parametrize("token", [None, "0" * 32])
def test_a_client_without_the_owner_token_gets_auth_error(owner, method, token):
    keys = ["auth_0", "auth_1"]
    owner.writer("auth").put(keys, {"x": values(keys)})
    args = dict(ADMIN_CALLS[method])
    if token is not None:
        args[OWNER_ARG] = token  # a guessed token is no better than none
    with rpc_client(owner.address, timeout=10) as stranger:
        with pytest.raises(AuthError, match=f"{method!r} of ControllerService is an admin call"):
            stranger.call(method, args)
    assert torch.equal(_rows(owner, keys), values(keys))  # nothing changed


@pytest.mark.parametrize("method,args", [
    ("grant", {"partition": "auth", "slots": 2**30}),
    ("drop", {"partition": "auth"}),
    # files on the unit's host: read one of the stranger's choosing, write another
    ("load_rows", {"path": "/etc", "save": "x", "unit": 0}),
    ("save_rows", {"request": {"path": "/tmp", "save": "x", "unit": 0, "partitions": {}}}),
    ("held", {}),  # every row's slot and token
    # the owner's memory bound, and what goes to disk
    ("set_memory", {"partition": "auth", "memory_budget": 2**40, "cold": []}),
    ("may_spill", {"partition": "auth", "slots": np.array([0]), "fields": ["x"]}),
])
def test_unit_admin_calls_need_the_owner_token(owner, method, args):
    keys = ["auth_2"]
    owner.writer("auth").put(keys, {"x": values(keys)})
    unit = owner.connection.controller().units()[0].address
    with rpc_client(unit, timeout=10) as stranger:
        with pytest.raises(AuthError, match="admin call"):
            stranger.call(method, args)
        with pytest.raises(StateError, match="controller placed"):  # the grant did not happen
            stranger.call("put", {"partition": "auth", "slots": np.array([2**29]),
                                  "columns": {"x": torch.ones(1, 3)}})
    assert torch.equal(_rows(owner, keys), values(keys))


def test_a_connected_handle_is_not_the_owner(owner):
    keys = ["auth_3", "auth_4"]
    owner.writer("auth").put(keys, {"x": values(keys)})
    joined = tq.connect(owner.address, config=owner.config)
    try:
        with pytest.raises(AuthError, match="admin call"):
            joined.kv.clear(partition="auth")  # every row: the owner's call
        with pytest.raises(AuthError, match="admin call"):
            joined.save("/nonexistent/never-written")
        assert joined.kv.clear(["auth_3"], partition="auth") == 1  # named keys: data plane
    finally:
        joined.close()
    assert torch.equal(_rows(owner, ["auth_4"]), values(["auth_4"]))


def test_the_owner_can_still_make_admin_calls(owner, tmp_path):
    keys = ["own_0", "own_1"]
    owner.writer("own").put(keys, {"x": values(keys)})
    path = str(tmp_path / "ckpt")
    owner.save(path)  # state_dict
    assert owner.owner.restart_unit(0)["own"] == 2  # drop_unit
    assert owner.kv.clear(partition="own") == 0  # clear_partition (rows went with the unit)
    restored = tq.init(mode="local", storage_units=1, restore=path, config=owner.config)
    try:  # load_state_dict, and the restored slots were granted to the new unit
        assert torch.equal(restored.kv.get_batch(keys, partition="own")["x"], values(keys))
    finally:
        restored.close()


def test_tcp_without_curve_warns_and_refuses_other_interfaces(caplog):
    with caplog.at_level(logging.WARNING, logger="tq_stream.deploy.local"):
        stream = start_local(storage_units=1, transport="tcp")
    stream.close()
    assert any("without curve" in r.getMessage() for r in caplog.records)

    class Echo:
        RPC_TABLE = Methods({"echo"})

        def echo(self, value):
            return value

    with pytest.raises(ConfigError, match="address must be loopback.*0.0.0.0"):
        RpcServer(Echo(), "tcp://0.0.0.0:0")
    with RpcServer(Echo(), "tcp://0.0.0.0:0", allow_insecure=True) as server, \
            rpc_client(server.address, timeout=5) as client:
        assert client.call("echo", {"value": 1}) == 1
