"""Typed messages: one declaration per RPC, checked against its method, a struct on
the wire as the map of its fields."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from tq_stream.deploy.services import ControllerService, UnitService
from tq_stream.errors import ConfigError, SerializationError
from tq_stream.messages import puts, unit
from tq_stream.messages.puts import Placement, Rows
from tq_stream.messages.rpc import Rpc, RpcTable
from tq_stream.serialization import decode, encode
from tq_stream.transport.dispatch import Dispatcher


def test_the_services_flags_are_their_tables():
    t = ControllerService.RPC_TABLE
    assert t.waits == {"get_meta": "consume", "reserve": "produce",
                       "admit": "produce", "reserve_shared": "produce"}
    assert t.replies == {"get_meta"}
    assert t.admin == {"attach_units", "drop_unit", "state_dict", "load_state_dict",
                       "clear_partition", "unit_lost"}
    for name in ("get_meta", "ack", "clear", "abort", "list_rows", "register_task"):
        assert name not in t.inline  # they wait or free storage through the units
    assert UnitService.RPC_TABLE.methods - UnitService.RPC_TABLE.inline == {
        "prepare_write", "save_rows", "load_rows", "set_memory", "may_spill"}


def test_a_server_refuses_a_method_whose_signature_is_not_its_request():
    Dispatcher(ControllerService(1))  # every method takes its request's fields

    class Echo(msgspec.Struct, kw_only=True):
        value: int
        times: int = 1

    class Handler:
        RPC_TABLE = RpcTable([Rpc("echo", Echo, int)])

        def echo(self, value: int, times: int = 2) -> int:  # another default
            return value * times

    with pytest.raises(ConfigError, match="echo must take the fields of Echo"):
        Dispatcher(Handler())


def test_a_reply_struct_is_a_map_on_the_wire_and_decodes_to_its_type():
    rows = np.arange(2, dtype=np.int64)
    placed = Placement(index=rows, unit=rows * 0, slot=rows, generation=rows * 0,
                       new=np.ones(2, bool), schemas={}, spare=Rows(rows, rows, rows, rows))
    wire = decode(encode(placed, inline=1024))
    assert isinstance(wire, dict) and wire["index"].tolist() == [0, 1]
    assert "lost" not in wire and "holder_left" not in wire  # None by default: left out
    got = puts.RESERVE.decode(wire)
    assert isinstance(got, Placement) and isinstance(got.spare, Rows)
    assert got.slot.tolist() == [0, 1] and got.lost is None


def test_a_reply_of_another_shape_is_refused_naming_the_rpc():
    with pytest.raises(SerializationError, match="reply of .ping. must be a UnitPing"):
        unit.PING.decode({"pid": "not a pid"})


def test_a_request_is_the_map_of_its_fields_with_the_methods_defaults():
    args = puts.RESERVE.args(puts.Reserve(partition="p", keys=["a"], schemas={}))
    assert args["unit"] == -1 and args["timeout"] == 60.0 and args["expect"] is None
