"""OwnerWatch: tells a client that nothing will serve or restart its deployment again.

The servers of a local deployment are children of the process that called
``tq.init`` (its owner): they exit when it exits or dies, and only it restarts them
(``restart_units``, ``restart_controller``). A call that lost its server keeps
trying while a restart may come; once the owner is gone none will, so the
transports ask ``check()`` while they wait and stop with ``DeploymentGone``,
which names the deployment, instead of waiting out their timeout.

The owner is known by its pid, its start time (a pid is reused) and its host: a
client on another host cannot see it (nor can it reach a local deployment), so
there the watch never says gone. A Ray deployment's owner record also names its
actors (``ray``): a client connected to Ray asks Ray, at most every
``RAY_INTERVAL`` seconds, whether its controller actor or the owner's node is gone
for good (``connection.ray_owner``). A watch without an owner never says gone.
"""

from __future__ import annotations

import os
import time
from typing import Any

from tq_stream import hosts
from tq_stream.connection import ray_owner
from tq_stream.errors import DeploymentGone

CHECK_INTERVAL = 0.5  # seconds a transport waits between two looks at the owner
RAY_INTERVAL = 2.0  # seconds between two questions to Ray (each a call to its GCS)


def owner_of_this_process() -> dict[str, Any]:
    """The owner record of a deployment started by this process (sent to clients)."""
    pid = os.getpid()
    return {"pid": pid, "host": hosts.host_id(), "started": _start_time(pid)}


class OwnerWatch:
    """Whether the owner of the deployment at ``address`` still lives.

    Args:
        address: the deployment's controller address (named in the error).
        owner: ``owner_of_this_process()`` of the owner, or None (unknown: never gone).
    """

    def __init__(self, address: str, owner: dict[str, Any] | None = None) -> None:
        self.address = address
        self.owner = owner
        self._ray_asked = float("-inf")
        self._ray_gone: str | None = None  # once gone, gone for good

    def learn(self, owner: dict[str, Any] | None) -> None:
        """Take the owner record a controller's ``ping`` reported (None: keep the one
        known)."""
        if owner is not None:
            self.owner = dict(owner)

    def gone(self) -> str | None:
        """Why nothing will serve the deployment again, or None while it may."""
        owner = self.owner
        if not owner:
            return None
        return self._process_gone(owner) or self._ray_says(owner)

    def _ray_says(self, owner: dict[str, Any]) -> str | None:
        deployment = owner.get("ray")
        if deployment is None or self._ray_gone is not None:
            return self._ray_gone
        now = time.monotonic()
        if now - self._ray_asked >= RAY_INTERVAL:
            self._ray_asked = now
            self._ray_gone = ray_owner.gone(deployment)
        return self._ray_gone

    @staticmethod
    def _process_gone(owner: dict[str, Any]) -> str | None:
        """Why the owner process is gone (on this host only), or None."""
        if owner.get("host") != hosts.host_id():
            return None
        pid = int(owner["pid"])
        started = _start_time(pid)
        if started is None:
            return f"its owner process (pid {pid}, which called tq.init) has exited"
        if owner.get("started") not in (None, started):
            return f"its owner process (pid {pid}, which called tq.init) has exited " \
                   f"(another process has its pid now)"
        return None

    def check(self) -> None:
        """Raise DeploymentGone if nothing will serve the deployment again."""
        reason = self.gone()
        if reason is not None:
            raise DeploymentGone(f"the tq_stream deployment at {self.address} is gone: "
                                 f"{reason}, so nothing serves or restarts its servers; "
                                 f"start a new one (tq.init) and connect to its address")


def check_folder(address: str) -> None:
    """Raise DeploymentGone if ``address`` is a unix socket (``unix://``, ``ipc://``) whose
    folder does not exist: a local deployment removes it when it stops, so nothing
    serves there (a connect fails at once instead of retrying for its timeout)."""
    for scheme in ("unix://", "ipc://"):
        if address.startswith(scheme):
            folder = os.path.dirname(address[len(scheme):])
            if not os.path.isdir(folder):
                raise DeploymentGone(f"no tq_stream deployment at {address}: its socket "
                                     f"folder {folder} does not exist (the deployment "
                                     f"stopped, or the address is wrong)")


def _start_time(pid: int) -> int | None:
    """The start time of live process ``pid`` (clock ticks since boot; 0 where /proc is
    missing), or None if no such process runs (a zombie has ended)."""
    if not os.path.exists("/proc/self/stat"):  # not Linux
        return _alive_by_signal(pid)
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    except OSError:
        return _alive_by_signal(pid)
    if fields[0] in ("Z", "X"):  # ended, not yet reaped by its parent
        return None
    return int(fields[19])


def _alive_by_signal(pid: int) -> int | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return 0
