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

import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from tq_stream.errors import ConfigError, StateError

DEFAULT_NAME = "tq_stream"
DEFAULT_NAMESPACE = "tq_stream"


class _Service:
    """The body of every tq_stream actor: serve one role in this process (zmq for
    other nodes, a unix socket for this one)."""

    def __init__(self, role: str, units: int, sampler_modules: Sequence[str], shm: bool,
                 curve_secret: str, curve_server: str,
                 unit_timeout: float | None = None) -> None:
        import ray

        from tq_stream.deploy.server import serve
        from tq_stream.deploy.services import host_id

        ip = ray.util.get_node_ip_address()
        # Clients on this node reach the service over a unix socket (lower latency
        # than zmq); the folder is private to this user. Not with CURVE: unencrypted.
        self._dir = None if curve_secret else tempfile.mkdtemp(prefix="tq_ray_")
        self._server, self._stop, local = serve(
            role, f"tcp://{ip}:0", units, tuple(sampler_modules), shm,
            curve_secret.encode() or None, curve_server.encode() or None,
            local_dir=self._dir, unit_timeout=unit_timeout)
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
        unit_timeout: seconds the controller waits for a silent unit (its actor died,
            its node left) before its rows are lost and no new rows go there.
    """

    def __init__(self, n_units: int, name: str = DEFAULT_NAME,
                 namespace: str = DEFAULT_NAMESPACE, sampler_modules: Sequence[str] = (),
                 shm: bool = True, curve: bool = False,
                 nodes: Sequence[str] | None = None, start_timeout: float = 120.0,
                 unit_timeout: float | None = None) -> None:
        try:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        except ImportError:
            raise ConfigError("mode must be 'embedded' or 'local' when ray is not installed "
                              "(pip install 'tq_stream[ray]'), got 'ray'") from None
        if not ray.is_initialized():
            ray.init(namespace=namespace, log_to_driver=False)
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
        actor = ray.remote(num_cpus=0, max_concurrency=4)(_Service)
        self._actors: list[Any] = []
        self._closed = False
        try:
            for i in range(n_units):
                strategy = NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False)
                self._actors.append(actor.options(
                    name=f"{name}_unit{i}", namespace=namespace, scheduling_strategy=strategy,
                ).remote("unit", 1, (), shm, secret, server))
            self._actors.append(actor.options(
                name=f"{name}_controller", namespace=namespace,
            ).remote("controller", n_units, tuple(sampler_modules), shm, secret, server,
                     unit_timeout))
            self._infos = ray.get([a.info.remote() for a in self._actors],
                                  timeout=start_timeout)
        except BaseException:
            self.close()
            raise
        self.address: str = self._infos[-1]["address"]
        self._backend: Any = None

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
        import ray

        if self._backend is not None:
            self._backend.close()
        for a in self._actors:
            try:
                ray.get(a.stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - a dead actor is already stopped
                pass
            ray.kill(a)


def controller_address(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE) -> str:
    """The zmq address of a Ray deployment's controller, looked up by actor name."""
    import ray

    try:
        actor = ray.get_actor(f"{name}_controller", namespace=namespace)
    except ValueError:
        raise ConfigError(f"name must be that of a running Ray deployment in namespace "
                          f"{namespace!r}, got {name!r}") from None
    return ray.get(actor.info.remote(), timeout=30)["address"]
