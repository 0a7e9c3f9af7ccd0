"""The controller served over sockets (the storage unit's handler: ``unit_service.py``).

Each serves the table of its RPCs (``RPC_TABLE``, from ``tq_stream.messages``: requests,
replies, flags); arguments and results are plain data, numpy arrays, normalized columns
and reply structs, carried by ``tq_stream.serialization`` without pickle. Admin RPCs
are the deployment owner's only (``tq_stream.transport.dispatch``). A served unit
stores rows only in slots the controller granted it (``tq_stream.deploy.grants``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tq_stream import hosts
from tq_stream.connection.unit_client import UnitClient
from tq_stream.controller import Controller
from tq_stream.controller.reservations import DEFAULT_WRITE_LEASE
from tq_stream.controller.task_config import TaskConfig
from tq_stream.controller.units import UNIT_LOST  # noqa: F401  (re-exported)
from tq_stream.deploy.grants import GrantFailed, SlotGrants, placed
from tq_stream.deploy.meta_checkpoint import Recovery
from tq_stream.deploy.unit_epoch import EpochReply, units_epoch
from tq_stream.deploy.unit_service import UnitService as UnitService  # re-exported
from tq_stream.deploy.unit_watch import DEFAULT_UNIT_TIMEOUT, UnitWatch, process_alive
from tq_stream.errors import AuthError, ConfigError, StateError
from tq_stream.handling import ANSWERED, Reply, WouldBlock, may_block
from tq_stream.messages import admin, media, puts, reads
from tq_stream.messages import unit as um
from tq_stream.messages.admin import Ping
from tq_stream.messages.puts import Committed, Placement, Rows
from tq_stream.messages.rpc import Req, Rpc, RpcTable
from tq_stream.samplers.base import Sampler
from tq_stream.samplers.spec import from_spec
from tq_stream.transport.answers import send_given
from tq_stream.transport.base import Transport
from tq_stream.transport.dispatch import rpc_stats

logger = logging.getLogger(__name__)
ATTACH_WAIT = 30.0  # seconds a call that needs the units waits for them to attach


def _count(value: object) -> int:
    """Rows a received argument asks for (a key list's length, or an int); 0 if it is
    malformed (the controller's own checks then reject it)."""
    if isinstance(value, list | tuple):
        return len(value)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class ControllerService(Controller):
    """The Controller, plus what a remote deployment needs around it.

    ``units`` are RPC clients of the storage units, attached once they are up;
    samplers arrive as specs (``tq_stream.samplers.spec``). Every slot a reply names
    is granted to its unit before the reply is sent (``tq_stream.deploy.grants``);
    ``owner_token`` authorizes this controller's admin calls to the units. With
    ``checkpoint_path`` its metadata is written there every ``checkpoint_interval``
    seconds, and a controller started where such a file exists resumes from it
    (``deploy.meta_checkpoint``).
    """

    # what a server may call, and how: one ``Rpc`` per method (``tq_stream.messages``)
    RPC_TABLE = RpcTable(puts.RPCS, reads.RPCS, admin.RPCS, media.RPCS)

    def __init__(self, n_units: int, sampler_modules: Sequence[str] = (),
                 unit_client: Callable[[str], Transport] | None = None,
                 owner_token: str | None = None,
                 unit_timeout: float | None = DEFAULT_UNIT_TIMEOUT,
                 checkpoint_path: str | None = None,
                 checkpoint_interval: float | None = None,
                 owner: dict[str, Any] | None = None) -> None:
        super().__init__(n_units, free=self._free_remote, may_spill=self._may_spill_remote)
        self._owner = owner  # the process that restarts the servers (``ping`` tells)
        # Per unit: its address record, whose "pid" is the process last seen serving it.
        self._unit_addresses: list[dict[str, Any]] = []
        self._units_epoch = 0  # changes with the units' addresses (see ``units_epoch``)
        self._unit_timeout = unit_timeout
        self._watch: UnitWatch | None = None
        self._unit_clients: list[UnitClient] = []
        self._make_client = unit_client
        self._owner_token = owner_token
        self._sampler_modules = tuple(sampler_modules)
        self._attached = threading.Event()
        self._grants = SlotGrants(self._send_grant)
        # A unix address this controller is also served at, for clients on its host
        # (set by ``deploy.server.serve``; None when there is none).
        self.local_address: str | None = None
        # checkpoints and the restart from one (meta_checkpoint.py)
        self._recovery = Recovery(self, self._cond, self._parts, self._units,
                                  checkpoint_path, checkpoint_interval)
        self._recovery.start()

    @property
    def checkpoints(self) -> Recovery:
        """The checkpoints and ack journal of this controller (``Recovery``)."""
        return self._recovery

    @property
    def recovery(self) -> dict[str, Any]:
        """What the last restart from a checkpoint found (``Recovery.found``)."""
        return self._recovery.found

    CALL_TIMEOUT = 5.0  # seconds a free or a grant may wait for its unit (inside a call)

    def _silent(self, unit: int) -> bool:
        """True if ``unit`` is lost, missed its last heartbeat or did not take a grant."""
        return unit in self._units.dead or unit in self._grants.failed or (
            self._watch is not None and self._watch.silent(unit))

    def _live_units(self) -> np.ndarray:
        """Units new rows may be placed on: not lost, and not silent while another
        answers (a unit that died gets no rows while it is not declared lost yet)."""
        live = super()._live_units()
        answering = live[[not self._silent(u) for u in live.tolist()]]
        return answering if len(answering) else live

    def _call_unit(self, unit: int, rpc: Rpc[Req, None], request: Req) -> None:
        """A call of this controller to ``unit``: at once StateError if it is lost, else
        within ``CALL_TIMEOUT`` (and the unit timeout) at most."""
        if unit in self._units.dead:
            raise StateError(f"storage unit {unit} is lost (waiting for a restart)")
        if unit >= len(self._unit_clients):  # a restarted controller, units not back yet
            raise StateError(f"storage unit {unit} is not attached yet")
        timeout = min(self.CALL_TIMEOUT, self._unit_timeout or self.CALL_TIMEOUT)
        self._unit_clients[unit].call(rpc, request, timeout=timeout)

    def _free_remote(self, unit: int, partition: str, slots: np.ndarray) -> None:
        """Free slots in a unit. A silent unit is not called (the free is retried
        later), so an ack never waits long for a dead unit."""
        if self._silent(unit):
            raise StateError(f"storage unit {unit} is not answering its heartbeat")
        self._call_unit(unit, um.FREE, um.Slots(partition=partition, slots=slots))

    def _may_spill_remote(self, unit: int, partition: str, slots: np.ndarray,
                          fields: list[str]) -> None:
        """Tell a unit that ``fields`` of ``slots`` may spill (``spill_hints.py``)."""
        if self._silent(unit):
            raise StateError(f"storage unit {unit} is not answering its heartbeat")
        self._call_unit(unit, um.MAY_SPILL, um.MaySpill(partition=partition, slots=slots,
                                                        fields=fields))

    def _send_grant(self, unit: int, partition: str, slots: int) -> None:
        # A restarted controller serves calls before its owner attached the units again
        # (moments later): a placement waits for them.
        if not self._attached.wait(timeout=ATTACH_WAIT):
            raise StateError(f"storage units must be attached before rows are placed; "
                             f"none were within {ATTACH_WAIT:g} s")
        self._call_unit(unit, um.GRANT, um.Grant(partition=partition, slots=slots))

    def attach_units(self, units: list[dict[str, Any]]) -> None:
        """Record the units' addresses (``[{"address", "host", "pid", "local"?}, ...]``;
        a unit on this host is called at its ``local`` address when it has one)."""
        if len(units) != self.n_units:
            raise ConfigError(f"units must list {self.n_units} storage units, got {len(units)}")
        self._unit_addresses = list(units)
        self._unit_clients = [self._client(u) for u in units]
        self._units_epoch = units_epoch(units)
        self._grants.forget_all()
        self._recovery.reconcile(self._unit_clients)  # after a restart from a checkpoint
        self._attached.set()
        if self._watch is None and self._unit_timeout is not None:
            self._watch = UnitWatch(self, lambda: list(self._unit_clients),
                                    self._unit_timeout)

    def _client(self, info: Mapping[str, Any]) -> UnitClient:
        """A client of the unit ``info`` records, at its nearest address."""
        if self._make_client is None:
            raise ConfigError("this controller service was made without a unit_client: it "
                              "cannot call storage units")
        return UnitClient(self._make_client(hosts.nearest(info)), None, self._owner_token)

    def unit_may_be_dead(self, unit: int) -> bool:
        """False if ``unit``'s process runs on this host and is alive (only slow)."""
        with self._cond:
            info = self._unit_addresses[unit] if unit < len(self._unit_addresses) else {}
        pid = int(info.get("pid", -1))
        if info.get("host") != hosts.host_id() or pid <= 0:
            return True  # another host: the missed heartbeats decide
        return not process_alive(pid)

    def unit_answered(self, unit: int, pid: int) -> None:
        """The watch heard from ``unit``'s process ``pid``: a new pid is a replacement
        (its rows died with the old process), so drop them if that has not happened
        yet and take the unit back."""
        self._grants.answered(unit)
        with self._cond:
            known = self._pid(unit)
            if known == pid and unit not in self._units.dead:
                return
            self._set_pid(unit, pid)
        if known != pid:
            self.unit_lost(unit)
        self.unit_back(unit)

    def _pid(self, unit: int) -> int | None:
        """The process last seen serving ``unit`` (lock held; None: none recorded)."""
        if unit >= len(self._unit_addresses):
            return None
        pid = self._unit_addresses[unit].get("pid")
        return None if pid is None else int(pid)

    def _set_pid(self, unit: int, pid: int) -> None:
        """``unit`` is served by process ``pid`` now (lock held): ``units()`` and so
        ``Stream.processes()`` name it (the record is replaced, never changed)."""
        if unit < len(self._unit_addresses):
            self._unit_addresses[unit] = {**self._unit_addresses[unit], "pid": int(pid)}

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
        self._recovery.stop()
        super().close()

    # ------------------------------------------------------- placement grants
    def _grants_cover(self, partition: str, n: int) -> bool:
        """True if placing ``n`` more rows in ``partition`` needs no new grant (lock held)."""
        part = self._parts.get(partition)
        ends = [(u, (0 if part is None else part.slot_end(u)) + n)
                for u in range(self.n_units)]
        return self._grants.covers(partition, ends)

    def _grant_placed(self, partition: str, *placed: Rows | Placement | None) -> None:
        for rows in placed:
            if rows is not None:
                self._grants.ensure(partition, rows.unit, rows.slot)

    def reserve(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                unit: int = -1, timeout: float = 60.0,
                expect: Sequence[int] | None = None, spare: int = 0, session: str = "",
                lease: float = DEFAULT_WRITE_LEASE,
                holder: Mapping[str, Any] | None = None, blocked: float = 0.0) -> Placement:
        # On the IO thread, a reserve that could need a grant (a call to a unit) goes to
        # a worker; the lock keeps a worker's placements from racing the check.
        def place() -> Placement:
            with self._cond:
                if not may_block() and not self._grants_cover(partition,
                                                              _count(keys) + _count(spare)):
                    raise WouldBlock
                return super(ControllerService, self).reserve(
                    partition, keys, schemas, unit, timeout, expect, spare, session, lease,
                    holder, blocked)

        out = placed(place, lambda out: self._grant_placed(partition, out, out.spare),
                     lambda out: self._undo(partition, out), self.n_units)
        out.units_epoch = self._units_epoch  # a reply of this call's own
        return out

    def _undo(self, partition: str, out: Placement) -> None:
        """Take back a reserve's placement: the rows it created, its spare rows."""
        new = out.new
        if new.any():
            self.abort(partition, out.index[new], out.generation[new])
        if out.spare is not None:
            self.release_spares(partition, out.spare.index, out.spare.generation)

    def commit_new(self, partition: str, keys: Sequence[str], index: Sequence[int] | np.ndarray,
                   generation: Sequence[int] | np.ndarray, schemas: Mapping[str, Any],
                   tags: list[dict[str, Any]] | None = None, unit: int = -1,
                   spare: int = 0) -> Committed:
        with self._cond:
            if not may_block() and not self._grants_cover(partition, _count(spare)):
                raise WouldBlock
            out = super().commit_new(partition, keys, index, generation, schemas, tags,
                                     unit, spare)
        spares = out.spare
        if spares is not None:
            send_given()  # the consumers it answered must not wait for a grant's call
            try:
                self._grant_placed(partition, spares)
            except GrantFailed:  # the rows are committed; only the spares are taken back
                self.release_spares(partition, spares.index, spares.generation)
                out.spare = None
        out.units_epoch = self._units_epoch  # a reply of this call's own
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Load the controller's state, then grant the units the slots it places (a
        controller restarting from its own checkpoint loads before the surviving units
        attach: they still hold their grants, and later placements grant as usual)."""
        super().load_state_dict(state)
        if not self._attached.is_set():
            return
        with self._cond:
            ends = [(name, u, part.slot_end(u)) for name, part in self._parts.items()
                    for u in range(self.n_units)]
        for name, u, end in ends:
            if end:
                self._grants.ensure_end(name, u, end)

    # ---------------------------------------------------------------- access
    def clear(self, partition: str, keys: Sequence[str] | None = None) -> int:
        """Clear ``keys``; clearing a whole partition is an admin call (``clear_partition``)."""
        if keys is None:
            raise AuthError(f"clearing every row of partition {partition!r} is an admin call "
                            "(clear_partition): only the deployment owner may make it; "
                            "name the keys to clear instead")
        return super().clear(partition, keys)

    def clear_partition(self, partition: str) -> int:
        """Free every row of ``partition`` (admin); returns how many were freed."""
        return super().clear(partition, None)

    def drop_unit(self, unit: int, info: dict[str, Any] | None = None) -> dict[str, int]:
        """Forget every row stored in storage unit ``unit``: its process died and a new,
        empty one serves in its place (``info``: the new unit's address record).

        A new unit may serve at another address (a Ray actor re-created, maybe on
        another node): this controller calls it there, and clients learn of it from
        ``units_epoch`` in the replies that place or hand out rows.

        Each task counts the rows it had not consumed yet (not acked, not discarded) as
        discarded with reason ``UNIT_LOST``; the rows' slots are reusable at once (there is
        nothing to free in the new unit). Writers and readers that still hold those rows
        get StateError (a commit of a cleared row, a read of a stale generation).

        Returns:
            rows dropped per partition.
        """
        self._units.check(unit)
        if info is not None and not isinstance(info.get("address"), str):
            raise ConfigError(f"info must name the new unit's 'address', got {info!r}")
        with self._cond:
            pid = None if info is None else info.get("pid")
            if pid is not None and self._pid(unit) == pid and unit not in self._units.dead:
                return {}  # the watch already took this very process back
            self._grants.forget_unit(unit)  # the new unit starts empty, with no grants
            if info is not None and self._unit_addresses:
                self._readdress(unit, dict(info))
            dropped = self._units.drop_rows_of(unit)
            self._units.dead.discard(unit)
            self._cond.notify_all()
        self._units.free_pending()  # rows elsewhere that named an entry lost there
        logger.warning("storage unit %d went down and was replaced by an empty one; rows "
                       "lost per partition (discarded as %r): %s", unit, UNIT_LOST, dropped)
        return dropped

    def _readdress(self, unit: int, info: dict[str, Any]) -> None:
        """Unit ``unit`` now serves as ``info`` (lock held): a new client if it moved."""
        old = self._unit_addresses[unit]
        self._unit_addresses[unit] = info
        if hosts.nearest(info) != hosts.nearest(old):
            retired, self._unit_clients[unit] = (self._unit_clients[unit], self._client(info))
            self._unit_clients = list(self._unit_clients)  # the watch reads a copy
            retired.close()
        if self._watch is not None:
            self._watch.replaced(unit)  # the owner started it: it answers
        self._units_epoch = units_epoch(self._unit_addresses)

    def get_meta(self, partition: str, task: str, step: int | None = None, dp_rank: int = 0,
                 timeout: float = 60.0, replica: int | None = None, session: str = "",
                 consumer: str = "",
                 reply: Reply[reads.StepMeta] | None = None) -> reads.StepMeta | None:
        """``Controller.get_meta``, whose reply (whichever thread formed it) names the
        units' epoch."""
        stamped = None if reply is None else EpochReply(reply, lambda: self._units_epoch)
        meta = super().get_meta(partition, task, step, dp_rank, timeout, replica, session,
                                consumer, stamped)
        if meta is not None and meta is not ANSWERED:
            meta.units_epoch = self._units_epoch  # a reply of this call's own
        return meta

    def units(self) -> list[dict[str, Any]]:
        if not self._attached.wait(timeout=ATTACH_WAIT):
            raise StateError(f"storage units must attach within {ATTACH_WAIT:g} s of the "
                             f"controller start")
        return list(self._unit_addresses)

    def ping(self) -> Ping:
        return Ping(pid=os.getpid(), host=hosts.host_id(), units=len(self._unit_addresses),
                    local=self.local_address, recovery=self.recovery,
                    dead_units=sorted(self._units.dead), units_epoch=self._units_epoch,
                    owner=self._owner)

    def unit_back(self, unit: int) -> None:
        """A new, empty unit serves as ``unit``: it holds no grants yet."""
        self._grants.forget_unit(unit)
        super().unit_back(unit)

    def server_stats(self) -> dict[str, Any]:
        """The controller process: its pid and the RPC calls it served."""
        return {"pid": os.getpid(), "rpc": rpc_stats()}

    def register(self, partition: str, task: str, config: TaskConfig,
                 sampler: Sampler | dict[str, Any] | None = None) -> None:
        """``Controller.register``, with ``sampler`` also a spec (``samplers.spec``); the
        registration of a default or spec sampler is remembered for a restart."""
        spec = sampler
        if isinstance(sampler, dict):
            sampler = from_spec(sampler, self._sampler_modules)
        super().register(partition, task, config, sampler)
        if spec is None or isinstance(spec, dict):
            self._recovery.remember(partition, task, config, spec)
