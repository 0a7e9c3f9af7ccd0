"""RayDeployment: the controller and storage units as named Ray actors.

Ray only places and supervises the processes: each actor starts the same zmq
server a local child runs, bound to its node's IP, plus a unix-socket server for
clients on its node (its ``local`` address; not with CURVE), and every client
talks to it directly over the nearest of the two, so tensor bytes never go
through Ray's object store or actor-call arguments. Units are spread one per
node (round robin over the alive nodes when there are more units than nodes).
Actors are named ``<name>_controller`` and ``<name>_unit<i>`` in ``namespace``;
any Ray task or actor can ``tq.connect()`` (which looks the controller up by
name) or simply receive the picklable Stream.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import logging
import os
import secrets
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from typing import Any

from tq_stream.errors import ConfigError, StateError, WaitTimeout, check_positive

logger = logging.getLogger(__name__)

DEFAULT_NAME = "tq_stream"
DEFAULT_NAMESPACE = "tq_stream"
STOP_TIMEOUT = 10.0  # seconds close() waits for the actors to stop before killing them
_FOLDER = "tq_ray_"  # prefix of an actor's socket folder: tq_ray_<pid>_<random>


def sweep_folders() -> int:
    """Remove the socket folders of tq_stream actors on this node whose process is gone
    (an actor killed with its driver cannot remove its own); returns how many."""
    from tq_stream.backends.shm import _pid_alive

    removed = 0
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{_FOLDER}*")):
        pid = os.path.basename(path)[len(_FOLDER):].split("_", 1)[0]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


class _Service:
    """The body of every tq_stream actor: serve one role in this process (zmq for
    other nodes, a unix socket for this one)."""

    def __init__(self, role: str, units: int, sampler_modules: Sequence[str], shm: bool,
                 curve_secret: str, curve_server: str, owner_token: str,
                 max_message: int | None, loopback: bool,
                 unit_timeout: float | None = None) -> None:
        import ray

        from tq_stream.deploy.server import serve
        from tq_stream.deploy.services import host_id

        sweep_folders()
        ip = "127.0.0.1" if loopback else ray.util.get_node_ip_address()
        # Clients on this node reach the service over a unix socket (lower latency
        # than zmq); the folder is private to this user. Not with CURVE: unencrypted.
        self._dir = None if curve_secret else tempfile.mkdtemp(prefix=f"{_FOLDER}{os.getpid()}_")
        self._server, self._stop, local = serve(
            role, f"tcp://{ip}:0", units, tuple(sampler_modules), shm,
            curve_secret.encode() or None, curve_server.encode() or None,
            local_dir=self._dir, owner_token=owner_token, max_message=max_message,
            allow_insecure=True,  # RayDeployment checked the bind (see its Args)
            unit_timeout=unit_timeout)
        self._info = {"address": self._server.address, "pid": os.getpid(), "host": host_id(),
                      "node": ray.get_runtime_context().get_node_id(), "local": local}

    def info(self) -> dict[str, Any]:
        return self._info

    def stop(self) -> None:
        self._stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _alive_nodes() -> list[str]:
    import ray

    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


class RayDeployment:
    """Owns the actors of ``tq.init(mode="ray")``.

    Args:
        n_units: storage unit actors (spread one per node).
        name, namespace: actor names are ``<name>_controller``, ``<name>_unit<i>``.
        sampler_modules: modules whose Sampler classes the controller may import.
        shm: keep dense slabs in shared memory for same-host reads.
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

    A deployment whose driver ends without ``stream.close()`` is closed at exit.
    """

    def __init__(self, n_units: int, name: str = DEFAULT_NAME,
                 namespace: str = DEFAULT_NAMESPACE, sampler_modules: Sequence[str] = (),
                 shm: bool = True, curve: bool = False,
                 nodes: Sequence[str] | None = None, start_timeout: float = 120.0,
                 max_message: int | None = None, allow_insecure_tcp: bool = False,
                 unit_timeout: float | None = None) -> None:
        try:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        except ImportError:
            raise ConfigError("mode must be 'embedded' or 'local' when ray is not installed "
                              "(pip install 'tq_stream[ray]'), got 'ray'") from None
        if max_message is not None:
            check_positive("max_message", max_message)
        self._actors: list[Any] = []
        self._infos: list[dict[str, Any]] = []
        self._backend: Any = None
        self._closed = False
        if not ray.is_initialized():
            ray.init(namespace=namespace)  # the servers' WARNINGs reach the driver
        self.owner_token = secrets.token_hex(16)
        self.curve_server_key: bytes | None = None
        secret = ""
        if curve:
            from tq_stream.transport.zeromq import generate_keys

            public, secret_b = generate_keys()
            self.curve_server_key, secret = public, secret_b.decode()
        server = (self.curve_server_key or b"").decode()
        nodes = list(nodes) if nodes is not None else _alive_nodes()
        if not nodes:
            raise StateError("a Ray cluster must have an alive node to place storage units")
        loopback = not curve and not allow_insecure_tcp
        if loopback and len(_alive_nodes()) > 1:
            raise ConfigError(
                "curve must be True on a Ray cluster of several nodes (its servers listen on "
                "the nodes' addresses, and anyone reaching them could read and write every "
                "row), got curve=False; pass allow_insecure_tcp=True on a trusted network")
        if not curve:
            logger.warning("tq_stream Ray mode without curve: any process that reaches the "
                           "servers' tcp ports can read and write rows%s",
                           "" if loopback else " (allow_insecure_tcp: on every node)")
        actor = ray.remote(num_cpus=0, max_concurrency=4)(_Service)
        args = (shm, secret, server, self.owner_token, max_message, loopback)
        try:
            for i in range(n_units):
                strategy = NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False)
                self._actors.append(actor.options(
                    name=f"{name}_unit{i}", namespace=namespace, scheduling_strategy=strategy,
                ).remote("unit", 1, (), *args))
            self._actors.append(actor.options(
                name=f"{name}_controller", namespace=namespace,
            ).remote("controller", n_units, tuple(sampler_modules), *args, unit_timeout))
            try:
                self._infos = ray.get([a.info.remote() for a in self._actors],
                                      timeout=start_timeout)
            except ray.exceptions.GetTimeoutError:
                raise WaitTimeout(f"tq_stream Ray actors must start within start_timeout="
                                  f"{start_timeout} s; they did not (the actors started were "
                                  "killed)") from None
        except BaseException:
            self._kill()
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

    def attach(self, backend: Any) -> None:
        self._backend = backend
        backend.controller().attach_units(
            [{k: i[k] for k in ("address", "pid", "host", "local")} for i in self._infos[:-1]])

    def save(self, path: str) -> None:
        from tq_stream.deploy import snapshot

        snapshot.save(path, self._backend.controller(), self._backend.units())

    def close(self) -> None:
        if self._closed:
            return
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


def controller_address(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE) -> str:
    """The zmq address of a Ray deployment's controller, looked up by actor name."""
    import ray

    try:
        actor = ray.get_actor(f"{name}_controller", namespace=namespace)
    except ValueError:
        raise ConfigError(f"name must be that of a running Ray deployment in namespace "
                          f"{namespace!r}, got {name!r}") from None
    return ray.get(actor.info.remote(), timeout=30)["address"]
