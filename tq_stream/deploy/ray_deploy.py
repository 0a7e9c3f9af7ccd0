"""RayDeployment: the controller and storage units as named Ray actors.

Ray only places and supervises the processes: each actor starts the same zmq
server a local child runs, bound to its node's IP, plus a unix-socket server for
clients on its node (its ``local`` address; not with CURVE), and every client
talks to it directly over the nearest of the two, so tensor bytes never go
through Ray's object store or actor-call arguments. Units are spread one per
node (round robin over the alive nodes when there are more units than nodes); the
controller runs on the driver's node.
Actors are named ``<name>_controller`` and ``<name>_unit<i>`` in ``namespace``;
any Ray task or actor can ``tq.connect()`` (which looks the controller up by
name) or simply receive the picklable Stream. The controller's ``info`` also carries
the driver's ``annotations`` (text, e.g. tq_stream.compat's shared settings) to every
process that finds the deployment by name, on any node. Dead actors are re-created by this
driver (``restart_units``, ``restart_controller``: ``deploy.ray_recovery``); the
actors' body and the look-up by name are in ``deploy.ray_actor``; a
client connected to Ray stops waiting with DeploymentGone once nothing will
(``connection.ray_owner``).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tq_stream.backends.kinds import storage_or_shm
from tq_stream.backends.spill import check_spill_dir
from tq_stream.config import DEFAULT_LEASE_TIMEOUT
from tq_stream.connection import ray_owner
from tq_stream.connection.owner_watch import owner_of_this_process
from tq_stream.deploy import ray_recovery
from tq_stream.deploy.ray_actor import (
    ACTOR_OPTIONS,
    DEFAULT_NAME,
    DEFAULT_NAMESPACE,
    FOLDER,
    RayService,
)
from tq_stream.errors import ConfigError, StateError, WaitTimeout, check_positive, check_timeout

if TYPE_CHECKING:
    from tq_stream.connection.remote import RemoteBackend

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0  # seconds close() waits for the actors to stop before killing them


def check_annotations(annotations: Mapping[str, str] | None) -> dict[str, str]:
    """``annotations`` as a plain dict of text (ConfigError if not str -> str)."""
    if annotations is None:
        return {}
    if not isinstance(annotations, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in annotations.items()):
        raise ConfigError(f"annotations must map str to str (text the deployment tells "
                          f"the processes that find it by name), got {annotations!r}")
    return dict(annotations)


class RayDeployment:
    """Owns the actors of ``tq.init(mode="ray")``.

    Args:
        n_units: storage unit actors (spread one per node).
        name, namespace: actor names are ``<name>_controller``, ``<name>_unit<i>``.
        sampler_modules: modules whose Sampler classes the controller may import.
        storage: the storage units' kind (``tq_stream.backends.kinds.KINDS``), "shm" by
            default (see LocalDeployment).
        shm: the older spelling of ``storage`` (True: "shm", False: "memory").
        curve: require CURVE encryption on every socket.
        nodes: node ids to place units on (default: every alive node).
        start_timeout: seconds the actors may take to start; after that every actor
            started is killed and WaitTimeout raised (a retry in the same cluster works).
        max_message: bytes one request to a server may carry (see LocalDeployment).
        allow_insecure_tcp: on a cluster of several nodes, serve unencrypted tcp on the
            nodes' addresses (refused otherwise: pass ``curve=True``). A one-node
            cluster without CURVE binds 127.0.0.1 only.
        unit_timeout: seconds the controller waits for a silent unit (its actor died,
            its node left) before its rows are lost and no new rows go there.
        restart_units: re-create a storage unit whose actor died or whose node left
            (empty, same unit index, a new address), from a watch thread in this process.
        checkpoint_interval: seconds between checkpoints of the controller's metadata;
            the controller is then pinned to this driver's node, where the file is
            (``checkpoint_path``, default a file in a private temporary folder).
        restart_controller: re-create a controller whose actor died, at the same
            address, from its last checkpoint (needs ``checkpoint_interval``).
        annotations: text (str -> str) the controller tells every process that looks
            the deployment up by name (``controller_info(name, namespace)
            ["annotations"]``), kept across controller restarts; set at start, so a
            process that finds the deployment finds them.
        spill_dir: the folder each unit spills rows under on its node
            (``backends/spill.py``; default the node's temporary folder).

    A deployment whose driver ends without ``stream.close()`` is closed at exit.
    """

    def __init__(self, n_units: int, name: str = DEFAULT_NAME,
                 namespace: str = DEFAULT_NAMESPACE, sampler_modules: Sequence[str] = (),
                 storage: str | None = None, shm: bool | None = None,
                 curve: bool = False,
                 nodes: Sequence[str] | None = None, start_timeout: float = 120.0,
                 max_message: int | None = None, allow_insecure_tcp: bool = False,
                 unit_timeout: float | None = None, restart_units: bool = False,
                 checkpoint_interval: float | None = None,
                 checkpoint_path: str | None = None,
                 restart_controller: bool = False,
                 annotations: Mapping[str, str] | None = None,
                 lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
                 spill_dir: str | None = None) -> None:
        try:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        except ImportError:
            raise ConfigError("mode must be 'embedded' or 'local' when ray is not installed "
                              "(pip install 'tq_stream[ray]'), got 'ray'") from None
        if max_message is not None:
            check_positive("max_message", max_message)
        if checkpoint_interval is not None:
            check_timeout("checkpoint_interval", checkpoint_interval)
        if restart_controller and checkpoint_interval is None:
            raise ConfigError("restart_controller=True needs checkpoint_interval (seconds "
                              "between checkpoints of the controller), got None")
        storage = storage_or_shm(storage, shm)
        self._unit_kwargs = {"spill_dir": check_spill_dir(spill_dir)}  # on each unit's node
        self.annotations = check_annotations(annotations)
        self._actors: list[Any] = []
        self._infos: list[dict[str, Any]] = []
        self._backend: RemoteBackend | None = None  # attach() sets it
        self._closed = False
        self._lock = threading.Lock()  # restarts: the watch thread or a caller
        self._watch: ray_recovery.RayWatch | None = None
        self._restart = (bool(restart_units), bool(restart_controller))
        self.start_timeout = start_timeout
        self.restarts: list[dict[str, Any]] = []  # controller restarts: how long, found
        if not ray.is_initialized():
            ray.init(namespace=namespace)  # the servers' WARNINGs reach the driver
        self.owner_token = secrets.token_hex(16)
        # The process that owns the actors (Ray kills them when it dies) and how clients
        # tell that the deployment is gone for good (``connection.ray_owner``).
        self.owner: dict[str, Any] = {**owner_of_this_process(),
                                      "ray": ray_owner.record(name, namespace,
                                                              restart_controller),
                                      "lease_timeout": lease_timeout}
        self.curve_server_key: bytes | None = None
        secret = ""
        if curve:
            from tq_stream.transport.zeromq import generate_keys

            public, secret_b = generate_keys()
            self.curve_server_key, secret = public, secret_b.decode()
        server = (self.curve_server_key or b"").decode()
        nodes = list(nodes) if nodes is not None else ray_recovery.alive_nodes()
        if not nodes:
            raise StateError("a Ray cluster must have an alive node to place storage units")
        loopback = not curve and not allow_insecure_tcp
        if loopback and len(ray_recovery.alive_nodes()) > 1:
            raise ConfigError(
                "curve must be True on a Ray cluster of several nodes (its servers listen on "
                "the nodes' addresses, and anyone reaching them could read and write every "
                "row), got curve=False; pass allow_insecure_tcp=True on a trusted network")
        if not curve:
            logger.warning("tq_stream Ray mode without curve: any process that reaches the "
                           "servers' tcp ports can read and write rows%s",
                           "" if loopback else " (allow_insecure_tcp: on every node)")
        actor = ray.remote(RayService)
        args = (storage, secret, server, self.owner_token, max_message, loopback)
        self._name, self._namespace, self._actor_class = name, namespace, actor
        self._unit_args = ("unit", 1, (), *args)
        self._ctrl_args = ("controller", n_units, tuple(sampler_modules), *args, unit_timeout)
        self._ctrl_kwargs, ctrl_options, self._ckpt_dir = self._checkpoint_options(
            checkpoint_interval, checkpoint_path, bool(curve))
        self.checkpoint_path = self._ctrl_kwargs.get("checkpoint", (None,))[0]
        try:
            for i in range(n_units):
                strategy = NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False)
                self._actors.append(actor.options(
                    **ACTOR_OPTIONS, name=f"{name}_unit{i}", namespace=namespace,
                    scheduling_strategy=strategy,
                ).remote(*self._unit_args, **self._unit_kwargs))
            self._actors.append(actor.options(
                **ACTOR_OPTIONS, name=f"{name}_controller", namespace=namespace,
                **ctrl_options,
            ).remote(*self._ctrl_args, **self._ctrl_kwargs, owner=self.owner,
                     annotations=self.annotations))
            try:
                self._infos = ray.get([a.info.remote() for a in self._actors],
                                      timeout=start_timeout)
            except ray.exceptions.GetTimeoutError:
                raise WaitTimeout(f"tq_stream Ray actors must start within start_timeout="
                                  f"{start_timeout} s; they did not (the actors started were "
                                  "killed)") from None
        except BaseException:
            self._kill()
            self._remove_folders()
            raise
        self.address: str = self._infos[-1]["address"]
        _OPEN.add(self)
        # Registered (again) after ray.init: exit hooks run last-in first-out, so this
        # one runs while Ray is still connected.
        atexit.unregister(_close_open_deployments)
        atexit.register(_close_open_deployments)

    @property
    def pids(self) -> list[int]:
        return [i["pid"] for i in self._infos]

    @property
    def unit_nodes(self) -> list[str]:
        return [i["node"] for i in self._infos[:-1]]

    @property
    def unit_infos(self) -> list[dict[str, Any]]:
        """Each unit's address record (``address``, ``pid``, ``host``, ``local``)."""
        return [{k: i[k] for k in ("address", "pid", "host", "local")}
                for i in self._infos[:-1]]

    @property
    def controller_node(self) -> str:
        return str(self._infos[-1]["node"])

    def actors(self) -> list[Any]:
        """The actors: the units in index order, then the controller (a copy; a restart
        replaces an actor)."""
        return list(self._actors)

    def dead_units(self) -> list[int]:
        """The units the controller declared lost (their heartbeats stopped)."""
        return list(self._attached("dead_units").controller().dead_units())

    def _checkpoint_options(self, interval: float | None, path: str | None,
                            curve: bool) -> tuple[dict[str, Any], dict[str, Any], str]:
        """The controller's checkpoint settings, its actor options and the checkpoint
        folder this made ("" if none). The controller runs on this driver's node (a
        node that leaves takes the driver with it; the checkpoint file is there); with
        a checkpoint its socket folder is named after this process, so that it outlives
        a controller actor."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        pinned = {"scheduling_strategy": NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False)}  # soft: spills elsewhere
        if interval is None:
            return {}, pinned, ""
        folder = ""
        if path is None:
            folder = tempfile.mkdtemp(prefix="tq_ckpt_")
            path = os.path.join(folder, "controller.tqmeta")
        kwargs: dict[str, Any] = {"checkpoint": (path, interval)}
        if not curve:
            kwargs["local_dir"] = tempfile.mkdtemp(prefix=f"{FOLDER}{os.getpid()}_")
        return kwargs, pinned, folder

    def attach(self, backend: RemoteBackend) -> None:
        self._backend = backend
        backend.controller().attach_units(self.unit_infos)
        if any(self._restart):
            self._watch = ray_recovery.RayWatch(self, *self._restart)

    def restart_unit(self, i: int, timeout: float | None = None,
                     elsewhere: bool = False) -> dict[str, int]:
        """Replace storage unit ``i`` by a new, empty actor (on its node if alive, else
        on the alive node holding the fewest units); the old actor is killed if it
        still runs. The controller drops the rows that lived there (counted as
        discarded, reason "unit_lost") and places rows on the new one.

        Args:
            elsewhere: prefer another node than the old one (it is suspect: the unit
                stopped answering there without Ray reporting its actor dead).

        Returns:
            rows dropped per partition.
        """
        n = len(self._infos) - 1
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ConfigError(f"i must be a unit index in [0, {n}), got {i!r}")
        with self._lock:
            backend = self._check_open("restart_unit")
            ray_recovery.kill(self._actors[i])
            ctrl = backend.controller()
            dropped = ctrl.unit_lost(i)  # before the new unit serves: no row goes there
            node = ray_recovery.unit_node(self._infos[i]["node"], self.unit_nodes, elsewhere)
            new = ray_recovery.create(self._actor_class, f"{self._name}_unit{i}",
                                      self._namespace, node, self._unit_args,
                                      self._unit_kwargs)
            self._actors[i] = new
            self._infos[i] = ray_recovery.started(new, f"storage unit {i}",
                                                  timeout or self.start_timeout)
            for name, rows in ctrl.drop_unit(i, self.unit_infos[i]).items():
                dropped[name] = dropped.get(name, 0) + rows
            return dropped

    def restart_controller(self, timeout: float | None = None) -> dict[str, Any]:
        """Replace the controller (killed if it still runs) by a new actor on the same
        node at the same address, which resumes from the last checkpoint; the units are
        attached again. Needs ``checkpoint_interval``.

        Returns:
            what the restart found (``recovery``: rows lost, slots freed, seconds),
            ``start_seconds`` (from this call to the new actor serving) and ``seconds``
            (to the units attached and reconciled).
        """
        if not self._ctrl_kwargs:
            raise ConfigError("restart_controller needs checkpoint_interval (a controller "
                              "without a checkpoint has nothing to resume from), got None")
        with self._lock:
            backend = self._check_open("restart_controller")
            begun = time.monotonic()
            ray_recovery.kill(self._actors[-1])
            new = ray_recovery.create(
                self._actor_class, f"{self._name}_controller", self._namespace,
                self.controller_node, self._ctrl_args,
                {**self._ctrl_kwargs, "address": self.address, "owner": self.owner,
                 "annotations": self.annotations})
            self._actors[-1] = new
            self._infos[-1] = ray_recovery.started(new, "controller",
                                                   timeout or self.start_timeout)
            serving = time.monotonic() - begun  # a new Ray worker, imports, the load
            ctrl = backend.controller()
            ctrl.attach_units(self.unit_infos)
            info = {"recovery": ctrl.ping().recovery, "start_seconds": serving,
                    "seconds": time.monotonic() - begun}
            self.restarts.append(info)
            logger.warning("the controller actor died and was re-created: %s", info)
            return info

    def _check_open(self, what: str) -> RemoteBackend:
        """The attached backend of this open deployment (StateError naming ``what``)."""
        if self._closed or self._backend is None:
            raise StateError(f"{what} must be called on an open, attached deployment")
        return self._backend

    def _attached(self, what: str) -> RemoteBackend:
        """The backend ``attach`` gave (StateError naming ``what`` before that)."""
        if self._backend is None:
            raise StateError(f"{what} must be called on an attached deployment (tq.init "
                             "attaches it), got one not attached yet")
        return self._backend

    def save(self, path: str) -> None:
        from tq_stream.deploy import snapshot

        backend = self._attached("save")
        snapshot.save(path, backend.controller(), backend.units())

    def close(self) -> None:
        if self._closed:
            return
        if self._watch is not None:
            self._watch.stop(timeout=self.start_timeout)
        with self._lock:
            self._closed = True
        _OPEN.discard(self)
        import ray

        if self._backend is not None:
            self._backend.close()
        if ray.is_initialized():  # stopped actors remove their socket folders
            with contextlib.suppress(Exception):
                ray.wait([a.stop.remote() for a in self._actors],
                         num_returns=len(self._actors), timeout=STOP_TIMEOUT)
        self._kill()
        self._remove_folders()

    def _remove_folders(self) -> None:
        """The checkpoint and socket folders this process made for the controller."""
        for folder in (self._ckpt_dir, self._ctrl_kwargs.get("local_dir")):
            if folder:
                shutil.rmtree(folder, ignore_errors=True)

    def _kill(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for a in self._actors:
            with contextlib.suppress(Exception):  # a dead actor is already gone
                ray.kill(a)
        self._actors = []


_OPEN: weakref.WeakSet[RayDeployment] = weakref.WeakSet()  # open in this driver


def _close_open_deployments() -> None:
    """A driver that ends without ``stream.close()`` still stops its actors (they
    remove their socket folders), before Ray's own exit hook disconnects."""
    for deployment in list(_OPEN):
        with contextlib.suppress(Exception):
            deployment.close()
