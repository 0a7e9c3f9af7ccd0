"""The body of every tq_stream Ray actor (``RayService``), and how a process finds a
deployment's controller actor by name (``controller_info``).

Each actor serves one role in its process: a zmq server bound to its node's IP for
other nodes, and a unix-socket server in a private folder (``tq_ray_<pid>_<random>``)
for clients on its node; ``sweep_folders`` removes the folders of actors that died.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

from tq_stream.errors import ConfigError

DEFAULT_NAME = "tq_stream"
DEFAULT_NAMESPACE = "tq_stream"
FOLDER = "tq_ray_"  # prefix of an actor's socket folder: tq_ray_<pid>_<random>
# The options every tq_stream actor is created with, given to each ``.options`` call
# (Ray's typed ``ray.remote(**options)`` is the tasks' one: no ``max_concurrency``).
ACTOR_OPTIONS = {"num_cpus": 0, "max_concurrency": 4}


class ActorInfo(TypedDict):
    """What a tq_stream actor tells about itself (``RayService.info``)."""

    address: str  # its zmq address, for other nodes
    pid: int
    host: str  # ``hosts.host_id()``
    node: str  # its Ray node id
    local: str | None  # its unix socket, for clients on its node (None with CURVE)
    curve_server_key: str  # the deployment's public key (z85 text; "" without CURVE)
    annotations: dict[str, str]  # the driver's (``RayDeployment``)


def sweep_folders() -> int:
    """Remove the socket folders of tq_stream actors on this node whose process is gone
    (an actor killed with its driver cannot remove its own); returns how many."""
    from tq_stream.backends.shm_sweep import pid_alive

    removed = 0
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{FOLDER}*")):
        pid = os.path.basename(path)[len(FOLDER):].split("_", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    return removed


class RayService:
    """The body of every tq_stream actor: serve one role in this process (zmq for
    other nodes, a unix socket for this one)."""

    def __init__(self, role: str, units: int, sampler_modules: Sequence[str], storage: str,
                 curve_secret: str, curve_server: str, owner_token: str,
                 max_message: int | None, loopback: bool,
                 unit_timeout: float | None = None, address: str | None = None,
                 local_dir: str | None = None,
                 checkpoint: tuple[str | None, float | None] = (None, None),
                 owner: dict[str, Any] | None = None,
                 annotations: dict[str, str] | None = None,
                 spill_dir: str | None = None) -> None:
        """``address``: the zmq address to bind (default: a free port); ``local_dir``:
        the folder of the unix socket (default: a new one); ``checkpoint``: the
        controller's (path, interval), see ``deploy.meta_checkpoint``; ``owner``: the
        deployment's owner record, which the controller's ``ping`` tells clients;
        ``annotations``: the driver's text that ``info`` tells (``RayDeployment``)."""
        import ray

        from tq_stream import hosts
        from tq_stream.deploy.server import serve

        sweep_folders()
        node_ip: Callable[[], str] = ray.util.get_node_ip_address  # unannotated in Ray
        ip = "127.0.0.1" if loopback else node_ip()
        # Clients on this node reach the service over a unix socket (lower latency
        # than zmq); the folder is private to this user. Not with CURVE: unencrypted.
        self._dir = None
        if not curve_secret and local_dir is not None:
            os.makedirs(local_dir, mode=0o700, exist_ok=True)
            self._dir = local_dir
        elif not curve_secret:
            self._dir = tempfile.mkdtemp(prefix=f"{FOLDER}{os.getpid()}_")
        self._server, self._stop, local = serve(
            role, address or f"tcp://{ip}:0", units, tuple(sampler_modules), storage,
            curve_secret.encode() or None, curve_server.encode() or None,
            local_dir=self._dir, owner_token=owner_token, max_message=max_message,
            allow_insecure=True,  # RayDeployment checked the bind (see its Args)
            unit_timeout=unit_timeout, checkpoint=checkpoint, owner=owner,
            spill_dir=spill_dir)
        self._info: ActorInfo = {
            "address": self._server.address, "pid": os.getpid(), "host": hosts.host_id(),
            "node": ray.get_runtime_context().get_node_id(), "local": local,
            "curve_server_key": curve_server,  # public: lets tq.connect() by name
            "annotations": dict(annotations or {})}

    def info(self) -> ActorInfo:
        return self._info

    def stop(self) -> None:
        self._stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def controller_address(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE) -> str:
    """The zmq address of a Ray deployment's controller, looked up by actor name."""
    return controller_info(name, namespace)["address"]


def controller_info(name: str = DEFAULT_NAME, namespace: str = DEFAULT_NAMESPACE
                    ) -> ActorInfo:
    """What the controller actor of a Ray deployment tells about itself, looked up by
    actor name: ``address``, ``curve_server_key`` (its public key, z85 text; "" without
    CURVE) and ``annotations`` (its driver's, see ``RayDeployment``), among others."""
    import ray

    try:
        actor = ray.get_actor(f"{name}_controller", namespace=namespace)
    except ValueError:
        raise ConfigError(f"name must be that of a running Ray deployment in namespace "
                          f"{namespace!r}, got {name!r}") from None
    info: ActorInfo = ray.get(actor.info.remote(), timeout=30)
    return info
