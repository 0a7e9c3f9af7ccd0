"""Every RPC's reply, of its declared type, arrives as that type: written on the wire
(``serialization.encode``), read back (``decode``) and decoded by its ``Rpc``."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest

from tq_stream.deploy.services import ControllerService, UnitService
from tq_stream.messages.rpc import Rpc
from tq_stream.serialization import decode, encode

RPCS = {f"{kind}.{name}": rpc
        for kind, table in (("controller", ControllerService.RPC_TABLE),
                            ("unit", UnitService.RPC_TABLE))
        for name, rpc in sorted(table.rpcs.items())}


def sample(info: msgspec.inspect.Type, required_only: bool = False) -> Any:
    """A value of the type ``info`` describes (a struct: every field set, or with
    ``required_only`` only those without a default)."""
    t = msgspec.inspect
    if isinstance(info, t.StructType):
        values = {f.name: sample(f.type, required_only) for f in info.fields
                  if f.required or not required_only}
        return info.cls(**values)
    if isinstance(info, t.UnionType):
        kinds = [k for k in info.types if not isinstance(k, t.NoneType)]
        return sample(kinds[0], required_only) if kinds else None
    if isinstance(info, t.ListType):
        return [sample(info.item_type, required_only)]
    if isinstance(info, t.DictType):
        return {"k": sample(info.value_type, required_only)}
    if isinstance(info, t.CustomType) and info.cls is np.ndarray:
        return np.arange(3, dtype=np.int64)
    plain = {t.IntType: 7, t.FloatType: 1.5, t.BoolType: True, t.StrType: "s",
             t.AnyType: "any", t.NoneType: None}
    return plain[type(info)]


def same(a: Any, b: Any) -> bool:
    """Equal values, numpy arrays compared by dtype and contents."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and \
            a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and same(msgspec.structs.asdict(a),
                                           msgspec.structs.asdict(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and \
            all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and \
            all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _reply(rpc: Rpc[Any, Any], required_only: bool) -> Any:
    return sample(msgspec.inspect.type_info(rpc.reply), required_only)


@pytest.mark.parametrize("required_only", [False, True], ids=["every field", "defaults"])
@pytest.mark.parametrize("name", sorted(RPCS))
def test_each_reply_round_trips_through_the_wire_as_its_type(name, required_only):
    rpc = RPCS[name]
    reply = _reply(rpc, required_only)
    got = rpc.decode(decode(encode(reply, inline=1 << 20)))
    assert same(got, reply), f"{name}: sent {reply!r}, got {got!r}"


@pytest.mark.parametrize("name", sorted(RPCS))
def test_a_reply_handed_over_in_process_stays_as_it_is(name):
    rpc = RPCS[name]
    reply = _reply(rpc, False)
    got = rpc.decode(reply)
    assert same(got, reply) and (not isinstance(reply, msgspec.Struct) or got is reply)


def _holds_struct(info: msgspec.inspect.Type) -> bool:
    t = msgspec.inspect
    if isinstance(info, t.UnionType):
        return any(_holds_struct(k) for k in info.types)
    if isinstance(info, t.ListType):
        return _holds_struct(info.item_type)
    return isinstance(info, t.StructType)


def test_the_replies_read_by_attribute_are_typed():
    typed = {n for n, r in RPCS.items() if _holds_struct(msgspec.inspect.type_info(r.reply))}
    assert {"controller.get_meta", "controller.lookup", "controller.locate",
            "controller.first_unfinished", "controller.task_rows", "controller.admission",
            "controller.media_hold", "controller.media_lookup", "controller.units",
            "controller.reserve", "controller.reserve_shared", "controller.commit_new",
            "controller.ping", "controller.list_tags", "unit.ping"} <= typed
