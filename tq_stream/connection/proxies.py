"""The client-side stand-in for a remote controller (a unit's: ``remote_unit.py``).

Every remote call is an explicit method here (no ``__getattr__`` proxying).
A long wait (``get_meta``, a ``reserve`` at capacity, ``admit``) is one request
that the server answers when its condition holds or its timeout expires (a
long-poll on a server worker thread); the transport waits ``MARGIN`` seconds
more, so a dead controller is told from a slow answer. ``cancel(session)``
ends a consumer's waiting ``get_meta`` early.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from tq_stream.config import DEFAULT_LEASE_TIMEOUT
from tq_stream.errors import AuthError, ConnectionLost, Unreachable, check_timeout
from tq_stream.messages import admin, media, puts, reads
from tq_stream.messages.puts import DEFAULT_WRITE_LEASE, Committed, Placement
from tq_stream.messages.rpc import Rep, Req, Rpc
from tq_stream.samplers.base import Sampler
from tq_stream.samplers.spec import to_spec
from tq_stream.transport.dispatch import OWNER_ARG

if TYPE_CHECKING:
    from tq_stream.transport.base import Transport

RETRY_PAUSE = 0.05  # seconds between calls to a controller that went away
P = TypeVar("P", Placement, Committed)  # a reply that names the units' epoch
MARGIN = 5.0  # extra seconds a reply may take beyond the server-side wait (at most
# the configured call timeout)


class RemoteController:
    """Calls a ControllerService through an RpcClient.

    ``owner_token``: the deployment owner's token, sent with admin calls only (a
    handle without it gets AuthError from them; see ``ControllerService.RPC_ADMIN``).
    ``on_units_moved()`` is called when a reply that places or hands out rows
    carries another ``units_epoch`` than the last one (a unit serves at a new address:
    a Ray actor re-created; and on the first such reply); the backend then checks the
    units' addresses again.
    """

    def __init__(self, rpc: Transport, timeout: float, owner_token: str | None = None,
                 on_units_moved: Callable[[], None] | None = None) -> None:
        self._rpc = rpc
        self._timeout = timeout
        self._owner_token = owner_token
        self._on_units_moved = on_units_moved
        self._units_epoch: int | None = None

    @property
    def address(self) -> str:
        """The address this client calls the controller at."""
        return self._rpc.address

    def _moved(self, epoch: int | None) -> None:
        """A reply that places or hands out rows named the units' ``epoch``: tell the
        backend of a change (the first one too: units may be known already)."""
        if epoch is not None and epoch != self._units_epoch:
            self._units_epoch = epoch
            if self._on_units_moved is not None:
                self._on_units_moved()

    def _placed(self, reply: P) -> P:
        self._moved(reply.units_epoch)
        return reply

    def _call(self, rpc: Rpc[Req, Rep], request: Req, timeout: float | None = None) -> Rep:
        return rpc.decode(self._again_if_lost(rpc.name, rpc.args(request),
                                              timeout or self._timeout))

    def _again_if_lost(self, method: str, args: dict[str, object], timeout: float,
                       wait: float | None = None) -> object:
        """Call ``method``; if the controller went away with the call (ConnectionLost),
        call it again, within ``timeout``, on the controller restarted at its address
        (a call whose effect the old one may have made: acks are journaled and a repeated
        one is a no-op; rows it placed or committed after its checkpoint are lost with
        it). Without a restart the retries end with WaitTimeout naming the address, or
        sooner with DeploymentGone once the deployment's owner is gone (the transport
        asks ``OwnerWatch.check``: nothing will restart the controller then).
        ``wait``: the server-side wait of a long-poll, shortened on a retry."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if wait is not None:
                args = {**args, "timeout": max(0.001, min(wait, left - (timeout - wait)))}
            try:
                return self._rpc.call(method, args, timeout=max(0.001, left))
            except (ConnectionLost, Unreachable):  # Unreachable: hung up before it was sent
                if time.monotonic() >= deadline:
                    raise
                time.sleep(RETRY_PAUSE)

    def _admin(self, rpc: Rpc[Req, Rep], request: Req) -> Rep:
        if self._owner_token is None:
            raise AuthError(f"{rpc.name} is an admin call: only the process that started the "
                            "deployment (its owner) may make it, and this handle is not it")
        args = {**rpc.args(request), OWNER_ARG: self._owner_token}
        return rpc.decode(self._again_if_lost(rpc.name, args, self._timeout))

    def _long_poll(self, rpc: Rpc[Req, Rep], request: Req, timeout: float) -> Rep:
        timeout = check_timeout("timeout", timeout)
        margin = min(MARGIN, max(1.0, self._timeout))  # a short timeout: notice death soon
        return rpc.decode(self._again_if_lost(rpc.name, rpc.args(request), timeout + margin,
                                              wait=timeout))

    # --- partitions and writes
    def create_partition(self, partition: str, capacity: int | None = None,
                         consumers: Sequence[str] | None = None,
                         spills: bool = False) -> None:
        self._call(puts.CREATE_PARTITION, puts.CreatePartition(
            partition=partition, capacity=capacity, spills=spills,
            consumers=None if consumers is None else list(consumers)))

    def close_partition(self, partition: str) -> None:
        self._call(puts.CLOSE_PARTITION, puts.ClosePartition(partition=partition))

    def partitions(self) -> list[str]:
        return self._call(puts.PARTITIONS, puts.Partitions())

    def reserve(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                unit: int = -1, timeout: float = 60.0, expect: Sequence[int] | None = None,
                spare: int = 0, session: str = "", lease: float = DEFAULT_WRITE_LEASE,
                holder: Mapping[str, Any] | None = None, blocked: float = 0.0) -> Placement:
        request = puts.Reserve(partition=partition, keys=list(keys), schemas=schemas,
                               unit=unit, timeout=timeout, expect=_array(expect), spare=spare,
                               session=session, lease=lease, holder=holder, blocked=blocked)
        return self._placed(self._long_poll(puts.RESERVE, request, timeout))

    def commit_new(self, partition: str, keys: Sequence[str], index: Sequence[int],
                   generation: Sequence[int], schemas: Mapping[str, Any],
                   tags: list[dict[str, Any]] | None = None, unit: int = -1,
                   spare: int = 0) -> Committed:
        return self._placed(self._call(puts.COMMIT_NEW, puts.CommitNew(
            partition=partition, keys=list(keys), index=index, generation=generation,
            schemas=schemas, tags=tags, unit=unit, spare=spare)))

    def release_spares(self, partition: str, index: np.ndarray, generation: np.ndarray,
                       timeout: float | None = None) -> int:
        return self._call(puts.RELEASE_SPARES, puts.RowsOf(
            partition=partition, index=index, generation=generation), timeout)

    def commit(self, partition: str, index: np.ndarray, generation: np.ndarray,
               schemas: Mapping[str, Any], tags: list[dict[str, Any]] | None = None,
               holder: Mapping[str, Any] | None = None,
               shared: Sequence[str | None] | None = None) -> None:
        self._call(puts.COMMIT, puts.Commit(
            partition=partition, index=index, generation=generation, schemas=schemas,
            tags=tags, holder=holder, shared=None if shared is None else list(shared)))

    def reserve_shared(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                       digests: Sequence[Mapping[str, str]], nbytes: Sequence[int],
                       unit: int = -1, timeout: float = 60.0, session: str = "",
                       lease: float = DEFAULT_WRITE_LEASE) -> Placement:
        return self._placed(self._long_poll(puts.RESERVE_SHARED, puts.ReserveShared(
            partition=partition, keys=list(keys), schemas=schemas,
            digests=[dict(d) for d in digests], nbytes=[int(n) for n in nbytes], unit=unit,
            timeout=timeout, session=session, lease=lease), timeout))

    def abort(self, partition: str, index: np.ndarray, generation: np.ndarray) -> None:
        self._call(puts.ABORT, puts.RowsOf(partition=partition, index=index,
                                          generation=generation))

    def media_hold(self, partition: str, keys: Sequence[str], session: str, holder: str,
                   lease: float, producer: bool, pending: float = 0.0,
                   pins: Sequence[str] | None = None) -> media.MediaHeld:
        return self._call(media.MEDIA_HOLD, media.MediaHold(
            partition=partition, keys=list(keys), session=session, holder=holder, lease=lease,
            producer=producer, pending=pending, pins=None if pins is None else list(pins)))

    def media_release(self, partition: str, pin: str, session: str, holder: str) -> None:
        self._call(media.MEDIA_RELEASE, media.MediaRelease(partition=partition, pin=pin,
                                                           session=session, holder=holder))

    def media_lookup(self, partition: str, key: str, index: int, generation: int, pin: str,
                     deployment: str, fields: Sequence[str]) -> media.MediaPlace:
        return self._call(media.MEDIA_LOOKUP, media.MediaLookup(
            partition=partition, key=key, index=index, generation=generation, pin=pin,
            deployment=deployment, fields=list(fields)))

    # --- tasks
    def register_task(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                      dp_size: int = 1, replicas: int = 1,
                      lease_timeout: float = DEFAULT_LEASE_TIMEOUT, drop_last: bool = False,
                      sampler: Sampler | None = None) -> None:
        self._call(reads.REGISTER_TASK, reads.RegisterTask(
            partition=partition, task=task, fields=list(fields), batch_size=batch_size,
            dp_size=dp_size, replicas=replicas, lease_timeout=lease_timeout,
            drop_last=drop_last, sampler=None if sampler is None else to_spec(sampler)))

    def set_version(self, partition: str, task: str, version: int,
                    at_step: int | None = None) -> None:
        self._call(reads.SET_VERSION, reads.SetVersion(partition=partition, task=task,
                                                       version=version, at_step=at_step))

    def reading(self, partition: str, task: str, step: int) -> None:
        self._call(reads.READING, reads.Reading(partition=partition, task=task, step=step))

    def admit(self, partition: str, n: int, timeout: float = 60.0) -> int:
        return self._long_poll(reads.ADMIT, reads.Admit(partition=partition, n=n,
                                                        timeout=timeout), timeout)

    def set_admission(self, partition: str, task: str, steps_per_version: int) -> None:
        self._call(reads.SET_ADMISSION, reads.SetAdmission(
            partition=partition, task=task, steps_per_version=steps_per_version))

    def admission(self, partition: str) -> reads.AdmissionStatus:
        return self._call(reads.ADMISSION, reads.OfPartition(partition=partition))

    def get_meta(self, partition: str, task: str, step: int | None = None, dp_rank: int = 0,
                 timeout: float = 60.0, replica: int | None = None, session: str = "",
                 consumer: str = "") -> reads.StepMeta | None:
        meta = self._long_poll(reads.GET_META, reads.GetMeta(
            partition=partition, task=task, step=step, dp_rank=dp_rank, timeout=timeout,
            replica=replica, session=session, consumer=consumer), timeout)
        if meta is not None:
            self._moved(meta.units_epoch)
        return meta

    def ack(self, partition: str, task: str, step: int, dp_rank: int, index: np.ndarray,
            generation: np.ndarray, replica: int = 0, session: str = "") -> int:
        return self._call(reads.ACK, reads.Ack(
            partition=partition, task=task, step=step, dp_rank=dp_rank, index=index,
            generation=generation, replica=replica, session=session))

    def release(self, partition: str, task: str, step: int, dp_rank: int, index: np.ndarray,
                generation: np.ndarray, replica: int = 0, session: str = "") -> None:
        self._call(reads.RELEASE, reads.Ack(
            partition=partition, task=task, step=step, dp_rank=dp_rank, index=index,
            generation=generation, replica=replica, session=session))

    def renew(self, partition: str, task: str, step: int | None = None,
              session: str = "") -> int:
        return self._call(reads.RENEW, reads.Renew(partition=partition, task=task, step=step,
                                                   session=session))

    def first_unfinished(self, partition: str, task: str, dp_rank: int = 0,
                         replica: int | None = None) -> reads.Resume:
        return self._call(reads.FIRST_UNFINISHED, reads.FirstUnfinished(
            partition=partition, task=task, dp_rank=dp_rank, replica=replica))

    def cancel(self, session: str) -> None:
        self._call(reads.CANCEL, reads.Cancel(session=session))

    # --- access
    def clear(self, partition: str, keys: Sequence[str] | None = None) -> int:
        if keys is None:
            return self._admin(admin.CLEAR_PARTITION, reads.OfPartition(partition=partition))
        return self._call(reads.CLEAR, reads.Clear(partition=partition, keys=list(keys)))

    def lookup(self, partition: str, keys: Sequence[str],
               fields: Sequence[str] | None = ()) -> reads.Found:
        return self._call(reads.LOOKUP, reads.Lookup(
            partition=partition, keys=list(keys), fields=None if fields is None else list(fields)))

    def locate(self, partition: str, keys: Sequence[str]) -> reads.Located:
        return self._call(reads.LOCATE, reads.Keys(partition=partition, keys=list(keys)))

    def list_rows(self, partition: str,
                  keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
        return self._call(reads.LIST_ROWS, reads.ListRows(
            partition=partition, keys=None if keys is None else list(keys)))

    def list_tags(self, partition: str) -> reads.TagColumns:
        return self._call(reads.LIST_TAGS, reads.OfPartition(partition=partition))

    def keys_of(self, partition: str, index: Sequence[int]) -> list[str]:
        return self._call(reads.KEYS_OF, reads.KeysOf(partition=partition,
                                                      index=np.asarray(index, dtype=np.int64)))

    def set_tags(self, partition: str, keys: Sequence[str], tags: list[dict[str, Any]]) -> None:
        self._call(reads.SET_TAGS, reads.SetTags(partition=partition, keys=list(keys),
                                                 tags=tags))

    def stats(self) -> dict[str, Any]:
        return self._call(reads.STATS, reads.Nothing())

    def task_rows(self, partition: str, task: str) -> reads.TaskRows:
        return self._call(reads.TASK_ROWS, reads.OfTask(partition=partition, task=task))

    # --- deployment
    def units(self) -> list[admin.UnitAddress]:
        return self._call(admin.UNITS, reads.Nothing())

    def attach_units(self, units: list[dict[str, Any]]) -> None:
        self._admin(admin.ATTACH_UNITS, admin.AttachUnits(units=units))

    def drop_unit(self, unit: int, info: dict[str, Any] | None = None) -> dict[str, int]:
        return self._admin(admin.DROP_UNIT, admin.DropUnit(unit=unit, info=info))

    def ping(self, timeout: float | None = None) -> admin.Ping:
        return self._call(admin.PING, reads.Nothing(), timeout)

    def server_stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self._call(admin.SERVER_STATS, reads.Nothing(), timeout)

    def dead_units(self) -> list[int]:
        return self._call(reads.DEAD_UNITS, reads.Nothing())

    def unit_lost(self, unit: int) -> dict[str, int]:
        return self._admin(admin.UNIT_LOST, admin.OfUnit(unit=unit))

    def state_dict(self) -> dict[str, Any]:
        return self._admin(admin.STATE_DICT, reads.Nothing())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._admin(admin.LOAD_STATE_DICT, admin.LoadState(state=state))

    def close(self) -> None:
        """Close this process's sockets to the controller (not the controller)."""
        self._rpc.close()


def _array(values: Sequence[int] | np.ndarray | None) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=np.int64)
