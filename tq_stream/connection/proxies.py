"""Client-side stand-ins for a remote controller and remote storage units.

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
from typing import TYPE_CHECKING, Any

import numpy as np

from tq_stream.backends.base import StorageUnit
from tq_stream.columns import Column
from tq_stream.errors import AuthError, ConnectionLost, Unreachable, check_timeout
from tq_stream.samplers.spec import to_spec
from tq_stream.transport.dispatch import OWNER_ARG

if TYPE_CHECKING:
    from tq_stream.transport.base import Transport

UNIT_FILE_TIMEOUT = 600.0  # seconds a unit may take to write or read its checkpoint file
RETRY_PAUSE = 0.05  # seconds between calls to a controller that went away
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

    def _placed(self, reply: Any) -> Any:
        """``reply`` without its ``units_epoch``, after telling the backend of a change."""
        if not isinstance(reply, dict) or "units_epoch" not in reply:
            return reply
        epoch = reply.pop("units_epoch")
        if epoch != self._units_epoch:  # the first one too: units may be known already
            self._units_epoch = epoch
            if self._on_units_moved is not None:
                self._on_units_moved()
        return reply

    def _call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        return self._again_if_lost(method, args, timeout or self._timeout)

    def _again_if_lost(self, method: str, args: dict[str, Any], timeout: float,
                       wait: float | None = None) -> Any:
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

    def _admin(self, method: str, **args: Any) -> Any:
        if self._owner_token is None:
            raise AuthError(f"{method} is an admin call: only the process that started the "
                            "deployment (its owner) may make it, and this handle is not it")
        return self._call(method, **args, **{OWNER_ARG: self._owner_token})

    def _long_poll(self, method: str, timeout: float, **args: Any) -> Any:
        timeout = check_timeout("timeout", timeout)
        margin = min(MARGIN, max(1.0, self._timeout))  # a short timeout: notice death soon
        return self._again_if_lost(method, args, timeout + margin, wait=timeout)

    # --- partitions and writes
    def create_partition(self, partition: str, capacity: int | None = None,
                         consumers: Sequence[str] | None = None,
                         spills: bool = False) -> None:
        self._call("create_partition", partition=partition, capacity=capacity,
                   consumers=None if consumers is None else list(consumers),
                   **({"spills": True} if spills else {}))

    def close_partition(self, partition: str) -> None:
        self._call("close_partition", partition=partition)

    def partitions(self) -> list[str]:
        return self._call("partitions")

    def reserve(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                unit: int = -1, timeout: float = 60.0, expect: Any = None, spare: int = 0,
                session: str = "", lease: float | None = None,
                holder: Mapping[str, Any] | None = None, blocked: float = 0.0) -> dict[str, Any]:
        extra: dict[str, Any] = {} if expect is None else {"expect": _array(expect)}
        if holder is not None:
            extra["holder"] = holder
        extra.update((k, v) for k, v in (("spare", spare), ("session", session),
                                         ("blocked", blocked)) if v)
        if lease is not None:
            extra["lease"] = lease
        return self._placed(self._long_poll("reserve", timeout, partition=partition,
                                            keys=list(keys), schemas=schemas, unit=unit,
                                            **extra))

    def commit_new(self, partition: str, keys: Sequence[str], index: Any, generation: Any,
                   schemas: Mapping[str, Any], tags: list | None = None, unit: int = -1,
                   spare: int = 0) -> dict[str, Any]:
        return self._placed(self._call("commit_new", partition=partition, keys=list(keys),
                                       index=index, generation=generation, schemas=schemas,
                                       tags=tags, unit=unit, spare=spare))

    def release_spares(self, partition: str, index: Any, generation: Any,
                       timeout: float | None = None) -> int:
        return self._call("release_spares", timeout, partition=partition, index=index,
                          generation=generation)

    def commit(self, partition: str, index: Any, generation: Any, schemas: Mapping[str, Any],
               tags: list | None = None, holder: Mapping[str, Any] | None = None,
               shared: Sequence[str | None] | None = None) -> None:
        extra: dict[str, Any] = {} if holder is None else {"holder": holder}
        if shared is not None:
            extra["shared"] = list(shared)
        self._call("commit", partition=partition, index=index, generation=generation,
                   schemas=schemas, tags=tags, **extra)

    def reserve_shared(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                       digests: Sequence[Mapping[str, str]], nbytes: Sequence[int],
                       unit: int = -1, timeout: float = 60.0, session: str = "",
                       lease: float | None = None) -> dict[str, Any]:
        extra = {} if lease is None else {"lease": lease}
        return self._placed(self._long_poll(
            "reserve_shared", timeout, partition=partition, keys=list(keys), schemas=schemas,
            digests=[dict(d) for d in digests], nbytes=[int(n) for n in nbytes], unit=unit,
            session=session, **extra))

    def abort(self, partition: str, index: Any, generation: Any) -> None:
        self._call("abort", partition=partition, index=index, generation=generation)

    def media_hold(self, partition: str, keys: Sequence[str], session: str, holder: str,
                   lease: float, producer: bool, pending: float = 0.0,
                   pins: Sequence[str] | None = None) -> dict[str, Any]:
        extra: dict[str, Any] = {} if pins is None else {"pins": list(pins)}
        return self._call("media_hold", partition=partition, keys=list(keys), session=session,
                          holder=holder, lease=lease, producer=producer, pending=pending,
                          **extra)

    def media_release(self, partition: str, pin: str, session: str, holder: str) -> None:
        self._call("media_release", partition=partition, pin=pin, session=session,
                   holder=holder)

    def media_lookup(self, partition: str, key: str, index: int, generation: int, pin: str,
                     deployment: str, fields: Sequence[str]) -> dict[str, Any]:
        return self._call("media_lookup", partition=partition, key=key, index=index,
                          generation=generation, pin=pin, deployment=deployment,
                          fields=list(fields))

    # --- tasks
    def register_task(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                      dp_size: int = 1, replicas: int = 1, lease_timeout: float = 300.0,
                      drop_last: bool = False, sampler: Any = None) -> None:
        spec = None if sampler is None else to_spec(sampler)
        self._call("register_task", partition=partition, task=task, fields=list(fields),
                   batch_size=batch_size, dp_size=dp_size, replicas=replicas,
                   lease_timeout=lease_timeout, drop_last=drop_last, sampler=spec)

    def set_version(self, partition: str, task: str, version: int,
                    at_step: int | None = None) -> None:
        self._call("set_version", partition=partition, task=task, version=version,
                   at_step=at_step)

    def reading(self, partition: str, task: str, step: int) -> None:
        self._call("reading", partition=partition, task=task, step=step)

    def admit(self, partition: str, n: int, timeout: float = 60.0) -> int:
        return self._long_poll("admit", timeout, partition=partition, n=n)

    def set_admission(self, partition: str, task: str, steps_per_version: int) -> None:
        self._call("set_admission", partition=partition, task=task,
                   steps_per_version=steps_per_version)

    def admission(self, partition: str) -> dict[str, Any]:
        return self._call("admission", partition=partition)

    def get_meta(self, partition: str, task: str, step: int | None = None, dp_rank: int = 0,
                 timeout: float = 60.0, replica: int | None = None, session: str = "",
                 consumer: str = "") -> dict[str, Any] | None:
        return self._placed(self._long_poll("get_meta", timeout, partition=partition,
                                            task=task, step=step, dp_rank=dp_rank,
                                            replica=replica, session=session,
                                            consumer=consumer))

    def ack(self, partition: str, task: str, step: int, dp_rank: int, index: Any,
            generation: Any, replica: int = 0, session: str = "") -> int:
        return self._call("ack", partition=partition, task=task, step=step, dp_rank=dp_rank,
                          index=index, generation=generation, replica=replica,
                          session=session)

    def release(self, partition: str, task: str, step: int, dp_rank: int, index: Any,
                generation: Any, replica: int = 0, session: str = "") -> None:
        self._call("release", partition=partition, task=task, step=step, dp_rank=dp_rank,
                   index=index, generation=generation, replica=replica, session=session)

    def renew(self, partition: str, task: str, step: int | None = None,
              session: str = "") -> int:
        return self._call("renew", partition=partition, task=task, step=step, session=session)

    def first_unfinished(self, partition: str, task: str, dp_rank: int = 0,
                         replica: int | None = None) -> dict[str, Any]:
        return self._call("first_unfinished", partition=partition, task=task, dp_rank=dp_rank,
                          replica=replica)

    def cancel(self, session: str) -> None:
        self._call("cancel", session=session)

    # --- access
    def clear(self, partition: str, keys: Sequence[str] | None = None) -> int:
        if keys is None:
            return self._admin("clear_partition", partition=partition)
        return self._call("clear", partition=partition, keys=list(keys))

    def lookup(self, partition: str, keys: Sequence[str],
               fields: Sequence[str] | None = ()) -> dict[str, Any]:
        return self._call("lookup", partition=partition, keys=list(keys),
                          fields=None if fields is None else list(fields))

    def locate(self, partition: str, keys: Sequence[str]) -> dict[str, Any]:
        return self._call("locate", partition=partition, keys=list(keys))

    def list_rows(self, partition: str,
                  keys: Sequence[str] | None = None) -> list[dict[str, Any]]:
        only = {} if keys is None else {"keys": list(keys)}
        return self._call("list_rows", partition=partition, **only)

    def list_tags(self, partition: str) -> dict[str, Any]:
        return self._call("list_tags", partition=partition)

    def keys_of(self, partition: str, index: Any) -> list[str]:
        return self._call("keys_of", partition=partition, index=_array(index))

    def set_tags(self, partition: str, keys: Sequence[str], tags: list) -> None:
        self._call("set_tags", partition=partition, keys=list(keys), tags=tags)

    def stats(self) -> dict[str, Any]:
        return self._call("stats")

    def task_rows(self, partition: str, task: str) -> dict[str, Any]:
        return self._call("task_rows", partition=partition, task=task)

    # --- deployment
    def units(self) -> list[dict[str, Any]]:
        return self._call("units")

    def attach_units(self, units: list[dict[str, Any]]) -> None:
        self._admin("attach_units", units=units)

    def drop_unit(self, unit: int, info: dict[str, Any] | None = None) -> dict[str, int]:
        return self._admin("drop_unit", unit=unit, info=info)

    def ping(self, timeout: float | None = None) -> dict[str, Any]:
        return self._call("ping", timeout)

    def server_stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self._call("server_stats", timeout)
    def dead_units(self) -> list[int]:
        return self._call("dead_units")

    def unit_lost(self, unit: int) -> dict[str, int]:
        return self._admin("unit_lost", unit=unit)

    def state_dict(self) -> dict[str, Any]:
        return self._admin("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._admin("load_state_dict", state=state)

    def close(self) -> None:
        """Close this process's sockets to the controller (not the controller)."""
        self._rpc.close()


def _array(values: np.ndarray | None) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=np.int64)


class RemoteUnit(StorageUnit):
    """A storage unit in another process, reached through an RpcClient.

    ``owner_token``: sent with the unit's admin calls (``drop``, ``save_rows``,
    ``load_rows``); a handle without it gets AuthError from them.
    """

    def __init__(self, rpc: Transport, timeout: float, owner_token: str | None = None) -> None:
        self._rpc = rpc
        self._timeout = timeout
        self._owner_token = owner_token

    def _admin(self, method: str, args: dict[str, Any], timeout: float) -> Any:
        if self._owner_token is None:
            raise AuthError(f"{method} is an admin call of a storage unit: only the process "
                            "that started the deployment (its owner) may make it, and this "
                            "handle is not it")
        return self._rpc.call(method, {**args, OWNER_ARG: self._owner_token}, timeout=timeout)

    def put(self, partition: str, slots: np.ndarray, columns: dict[str, Column],
            generations: np.ndarray | None = None) -> None:
        self._rpc.call("put", {"partition": partition, "slots": np.asarray(slots),
                               "columns": dict(columns), "generations": _array(generations)},
                       timeout=self._timeout)

    def get(self, partition: str, slots: np.ndarray, fields: Sequence[str],
            generations: np.ndarray | None = None) -> dict[str, Column]:
        return self._rpc.call("get", {"partition": partition, "slots": np.asarray(slots),
                                      "fields": list(fields),
                                      "generations": _array(generations)},
                              timeout=self._timeout)

    def free(self, partition: str, slots: np.ndarray) -> None:
        self._rpc.call("free", {"partition": partition, "slots": np.asarray(slots)},
                       timeout=self._timeout)

    def drop(self, partition: str) -> None:
        self._admin("drop", {"partition": partition}, self._timeout)

    def may_spill(self, partition: str, slots: np.ndarray, fields: Sequence[str]) -> None:
        self._admin("may_spill", {"partition": partition, "slots": np.asarray(slots),
                                  "fields": list(fields)}, self._timeout)

    def set_memory(self, partition: str, memory_budget: int | None = None,
                   cold: Sequence[str] = ()) -> None:
        self._admin("set_memory", {"partition": partition, "memory_budget": memory_budget,
                                   "cold": list(cold)}, self._timeout)

    # --- same-host abilities (``backends.shared.SharedSlabs``): a unit without shared
    # memory answers layout with {} and prepare_write with a ConfigError
    def layout(self, partition: str, fields: Sequence[str],
               writable: bool = False) -> dict[str, Any]:
        args: dict[str, Any] = {"partition": partition, "fields": list(fields)}
        if writable:
            args["writable"] = True
        return self._rpc.call("layout", args)

    def spans(self, partition: str, slots: np.ndarray, fields: Sequence[str],
              generations: np.ndarray | None = None) -> dict[str, Any]:
        return self._rpc.call("spans", {"partition": partition, "slots": np.asarray(slots),
                                        "fields": list(fields),
                                        "generations": _array(generations)},
                              timeout=self._timeout)

    def prepare_write(self, partition: str, slots: np.ndarray, generations: np.ndarray | None,
                      fields: Mapping[str, Any],
                      arenas: Mapping[str, Any] | None = None) -> dict[str, Any]:
        args = {"partition": partition, "slots": slots, "generations": generations,
                "fields": dict(fields)}
        if arenas:
            args["arenas"] = dict(arenas)
        return self._rpc.call("prepare_write", args)

    def finish_write(self, partition: str, ticket: int, ok: bool = True,
                     columns: dict[str, Column] | None = None) -> None:
        args: dict[str, Any] = {"partition": partition, "ticket": ticket, "ok": ok}
        if columns:
            args["columns"] = dict(columns)
        self._rpc.call("finish_write", args, timeout=self._timeout)

    def nbytes(self) -> int:
        return self._rpc.call("nbytes", {}, timeout=self._timeout)

    def ping(self) -> dict[str, Any]:
        return self._rpc.call("ping", {}, timeout=self._timeout)

    def save_rows(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._admin("save_rows", {"request": request},
                           max(self._timeout, UNIT_FILE_TIMEOUT))

    def load_rows(self, path: str, save: str, unit: int) -> dict[str, Any]:
        return self._admin("load_rows", {"path": path, "save": save, "unit": unit},
                           max(self._timeout, UNIT_FILE_TIMEOUT))

    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self._rpc.call("stats", {}, timeout=timeout or self._timeout)

    def close(self) -> None:
        self._rpc.close()
