"""Slot grants and the owner token without sockets: the unit side refuses slots beyond
its grant, the controller side grants by doubling and forgets a replaced unit, and the
dispatcher serves admin methods only with the owner's token."""

from __future__ import annotations

import numpy as np
import pytest

from tq_stream.deploy.grants import MIN_GRANT, GrantFailed, SlotGrants, SlotLimits
from tq_stream.errors import AuthError, ConfigError, StateError
from tq_stream.transport.dispatch import OWNER_ARG, Dispatcher
from tq_stream.transport.handler import Methods

TOKEN = "t" * 32


def test_a_unit_accepts_only_granted_slots_and_grants_only_grow():
    limits = SlotLimits()
    with pytest.raises(StateError, match=r"below 0\), got slot 0"):
        limits.check("p", np.array([0]))
    limits.grant("p", 10)
    limits.check("p", np.array([0, 9]))
    limits.grant("p", 4)  # smaller: no change
    with pytest.raises(StateError, match=r"partition 'p' of this unit \(below 10\), got slot 10"):
        limits.check("p", np.array([3, 10]))
    limits.check("q", np.array([], dtype=np.int64))  # nothing to write, nothing to check
    with pytest.raises(ConfigError, match="slots must be an int"):
        limits.grant("p", -1)


def test_the_controller_grants_by_doubling_and_forgets_a_replaced_unit():
    sent: list[tuple[int, str, int]] = []
    grants = SlotGrants(lambda unit, partition, slots: sent.append((unit, partition, slots)))
    grants.ensure("p", np.array([0, 0, 1]), np.array([3, 5, 0]))
    assert sent == [(0, "p", MIN_GRANT), (1, "p", MIN_GRANT)]
    grants.ensure("p", np.array([0]), np.array([MIN_GRANT - 1]))  # covered: no call
    assert len(sent) == 2 and grants.covers("p", [(0, MIN_GRANT), (1, MIN_GRANT)])
    grants.ensure_end("p", 0, MIN_GRANT + 1)
    assert sent[-1] == (0, "p", 2 * MIN_GRANT)
    grants.forget_unit(0)
    assert not grants.covers("p", [(0, 1)]) and grants.covers("p", [(1, MIN_GRANT)])


def test_a_failed_grant_is_not_recorded():
    def refuse(unit: int, partition: str, slots: int) -> None:
        raise ConfigError("unit unreachable")

    grants = SlotGrants(refuse)
    with pytest.raises(GrantFailed, match="storage unit 0 did not take .*unit unreachable"):
        grants.ensure_end("p", 0, 1)
    assert not grants.covers("p", [(0, 1)])
    assert grants.failed == {0}  # placements skip it until it answers again
    grants.answered(0)
    assert grants.failed == set()


class _Service:
    RPC_TABLE = Methods({"read", "wipe"}, admin={"wipe"})

    def __init__(self) -> None:
        self.wiped = 0

    def read(self) -> int:
        return self.wiped

    def wipe(self) -> None:
        self.wiped += 1


@pytest.mark.parametrize("token", [None, "x" * 32, 5])
def test_admin_methods_need_the_owner_token(token):
    service = _Service()
    dispatch = Dispatcher(service, owner_token=TOKEN)
    args = {} if token is None else {OWNER_ARG: token}
    with pytest.raises(AuthError, match="'wipe' of _Service is an admin call"):
        dispatch("wipe", args)
    assert service.wiped == 0
    dispatch("wipe", {OWNER_ARG: TOKEN})
    assert service.wiped == 1 and dispatch("read", {}) == 1


def test_a_server_without_a_token_serves_no_admin_method():
    service = _Service()
    with pytest.raises(AuthError, match="without an owner token"):
        Dispatcher(service)("wipe", {OWNER_ARG: TOKEN})
    assert service.wiped == 0


def test_admin_names_and_tokens_are_checked_at_construction():
    class Bad(_Service):
        RPC_TABLE = Methods({"read", "wipe"}, admin={"nope"})

    with pytest.raises(ConfigError, match=r"RPC_TABLE.admin must be names in its methods, "
                                          r"got \['nope'\]"):
        Dispatcher(Bad(), owner_token=TOKEN)
    with pytest.raises(ConfigError, match="owner_token must be a str of at least 16"):
        Dispatcher(_Service(), owner_token="short")
