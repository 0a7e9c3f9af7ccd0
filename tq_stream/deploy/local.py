"""LocalDeployment: the controller and N storage units as child processes.

Children are started with ``python -m tq_stream.deploy.server`` (settings on
stdin) and all start in parallel. Each child watches a pipe whose write end
only this process holds, so the children exit when this process exits, even
by SIGKILL. ``close`` stops them (SIGTERM, then SIGKILL after a grace period)
and removes any shared-memory segment a unit left behind. ``restart_unit``
replaces a dead (or live) storage unit by an empty one at the same address; the
controller drops the rows that lived there (counted as discarded, "unit_lost").
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tq_stream.backends.kinds import storage_or_shm
from tq_stream.backends.spill import check_spill_dir
from tq_stream.config import DEFAULT_LEASE_TIMEOUT
from tq_stream.connection.owner_watch import owner_of_this_process
from tq_stream.deploy.children import Child, await_ready
from tq_stream.deploy.unit_watch import DEFAULT_UNIT_TIMEOUT
from tq_stream.errors import (
    ConfigError,
    StateError,
    check_positive,
    check_timeout,
)

if TYPE_CHECKING:
    from tq_stream.connection.proxies import RemoteController
    from tq_stream.connection.remote import RemoteBackend

logger = logging.getLogger(__name__)

START_TIMEOUT = 60.0
INSECURE_TCP = ("transport='tcp' without curve: any process on this host can connect to "
                "the controller and the storage units (127.0.0.1) and read or write rows; "
                "admin calls still need the owner's token. Use transport='unix' (a private "
                "folder) or curve=True")
_SCHEME = {"unix": "unix://", "ipc": "ipc://", "tcp": "tcp://"}


class LocalDeployment:
    """Owns the child processes of ``tq.init(mode="local")``.

    Args:
        n_units: storage unit processes.
        sampler_modules: modules (besides tq_stream.samplers) whose Sampler classes
            the controller may import for tasks.
        storage: the storage units' kind (``tq_stream.backends.kinds.KINDS``): "shm"
            (the default: dense slabs in shared memory, read and written in place by
            processes on this host) or "memory" (on each unit's heap).
        shm: the older spelling of ``storage``, kept working: True means "shm", False
            "memory".
        transport: "unix" (unix stream sockets, the lowest latency; the default),
            "tcp" (zmq on loopback, random ports; the default with ``curve``) or
            "ipc" (zmq on unix sockets). ``curve=True`` needs "tcp" or "ipc".
        curve: require CURVE encryption and the deployment's key on every socket.
        start_method: "fork" (fast; the default) or "spawn" (a fresh interpreter).
        max_message: bytes one request to a server may carry (default: 64 MiB for the
            controller, 4 GiB for a unit; see ``tq_stream.deploy.server.MAX_MESSAGE``).

    The owner token (``owner_token``, random per deployment) goes to the children
    only; admin calls need it (the ``admin`` RPCs of ``ControllerService.RPC_TABLE``).
        unit_timeout: seconds the controller waits for a silent storage unit before
            its rows are lost and no new rows go there (``deploy.unit_watch``).
        restart_units: restart a storage unit whose process died (empty, at the same
            address) from a watch thread in this process.
        checkpoint_interval: seconds between checkpoints of the controller's metadata
            (to ``checkpoint_path``, default a file in a private temporary folder);
            None: no checkpoints.
        restart_controller: restart a controller whose process died, from the last
            checkpoint (needs ``checkpoint_interval``); clients reconnect by themselves.
        spill_dir: the folder units spill rows under (``backends/spill.py``; default
            the deployment's folder, else the system's temporary folder).
    """

    def __init__(self, n_units: int, sampler_modules: Sequence[str] = (),
                 storage: str | None = None, shm: bool | None = None,
                 transport: str | None = None, curve: bool = False,
                 start_method: str = "fork", start_timeout: float = START_TIMEOUT,
                 max_message: int | None = None,
                 unit_timeout: float = DEFAULT_UNIT_TIMEOUT,
                 restart_units: bool = False, checkpoint_interval: float | None = None,
                 checkpoint_path: str | None = None,
                 restart_controller: bool = False,
                 lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
                 spill_dir: str | None = None) -> None:
        check_positive("storage_units", n_units)
        spill_dir = check_spill_dir(spill_dir)
        storage = storage_or_shm(storage, shm)
        check_timeout("unit_timeout", unit_timeout)
        if checkpoint_interval is not None:
            check_timeout("checkpoint_interval", checkpoint_interval)
        if restart_controller and checkpoint_interval is None:
            raise ConfigError("restart_controller=True needs checkpoint_interval (seconds "
                              "between checkpoints of the controller), got None")
        if start_method not in ("fork", "spawn"):
            raise ConfigError(f"start_method must be 'fork' or 'spawn', got {start_method!r}")
        if transport is None:
            transport = "tcp" if curve else "unix"  # CURVE is a zmq feature
        if transport not in _SCHEME:
            raise ConfigError(f"transport must be 'unix', 'tcp' or 'ipc', got {transport!r}")
        if curve and transport == "unix":
            raise ConfigError("curve=True needs transport 'tcp' or 'ipc' (zmq); unix sockets "
                              "are protected by their folder, not encrypted; got 'unix'")
        if max_message is not None:
            check_positive("max_message", max_message)
        if transport == "tcp" and not curve:
            logger.warning(INSECURE_TCP)
        self.owner_token = secrets.token_hex(16)
        # Who starts and restarts the servers: clients stop waiting once it is gone.
        # Its lease_timeout is the default of handles that join by address (``connect``).
        self.owner = {**owner_of_this_process(), "lease_timeout": lease_timeout}
        self.curve_server_key: bytes | None = None
        secret = ""
        if curve:
            from tq_stream.transport.zeromq import generate_keys

            public, secret_b = generate_keys()
            self.curve_server_key, secret = public, secret_b.decode()
        address = "tcp://127.0.0.1:0"
        self._ipc_dir = ""
        if transport in ("ipc", "unix"):
            import tempfile

            self._ipc_dir = tempfile.mkdtemp(prefix="tq_ipc_")
        self._ckpt_dir = ""
        if checkpoint_interval is not None and checkpoint_path is None:
            import tempfile

            self._ckpt_dir = tempfile.mkdtemp(prefix="tq_ckpt_")
            checkpoint_path = os.path.join(self._ckpt_dir, "controller.tqmeta")
        self.checkpoint_path = checkpoint_path
        base = {"storage": storage, "curve_secret": secret,
                "curve_server": (self.curve_server_key or b"").decode(),
                "owner_token": self.owner_token, "max_message": max_message,
                "owner": self.owner,  # units spill under the deployment's folder by default
                "spill_dir": spill_dir or self._ipc_dir or None}
        self._children: list[Child] = []
        self._start_method = start_method
        self._closed = False
        self._backend: RemoteBackend | None = None  # attach() sets it
        self._lock = threading.Lock()  # restart_unit: the watch thread or a caller
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None
        try:
            for i in range(n_units):
                addr = f"{_SCHEME[transport]}{self._ipc_dir}/unit{i}" if self._ipc_dir \
                    else address
                self._children.append(Child({**base, "role": "unit", "address": addr},
                                              start_method))
            addr = f"{_SCHEME[transport]}{self._ipc_dir}/controller" if self._ipc_dir \
                else address
            self._children.append(Child({**base, "role": "controller", "address": addr,
                                          "units": n_units, "unit_timeout": unit_timeout,
                                          "checkpoint_path": checkpoint_path,
                                          "checkpoint_interval": checkpoint_interval,
                                          "sampler_modules": list(sampler_modules)},
                                         start_method))
            await_ready(self._children, start_timeout)
        except BaseException:
            self.close()
            raise
        self.address: str = self._children[-1].served["address"]
        self._restart_units = bool(restart_units)
        self._restart_controller = bool(restart_controller)
        self.restarts: list[dict[str, Any]] = []  # controller restarts: when, how long

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self._children]

    def attach(self, backend: RemoteBackend) -> None:
        self._backend = backend
        backend.controller().attach_units([c.served for c in self._children[:-1]])
        if self._restart_units or self._restart_controller:
            self._watch = threading.Thread(target=self._watch_children, daemon=True,
                                           name="tq-restart")
            self._watch.start()

    WATCH_INTERVAL = 0.25  # seconds between two looks at the unit processes

    def _watch_children(self) -> None:
        """Restart what died: storage units (``restart_units``), the controller from its
        last checkpoint (``restart_controller``)."""
        while not self._stop.wait(self.WATCH_INTERVAL):
            n = len(self._children) - 1
            if self._restart_controller and self._children[n].proc.poll() is not None:
                try:
                    self.restart_controller()
                except Exception as exc:  # closing, or the start failed: try again
                    logger.warning("restarting the controller failed: %s", exc)
            for i in range(n if self._restart_units else 0):
                if self._stop.is_set():
                    return
                if self._children[i].proc.poll() is None:
                    continue
                try:
                    dropped = self.restart_unit(i)
                    logger.warning("storage unit %d died and was restarted; rows lost: %s",
                                   i, dropped or "(none)")
                except Exception as exc:  # closing, or the start failed: try again
                    logger.warning("restarting storage unit %d failed: %s", i, exc)

    def restart_controller(self, timeout: float = START_TIMEOUT) -> dict[str, Any]:
        """Replace the controller (killed if it still runs) by a new one at the same
        address that resumes from the last checkpoint and re-attaches the units.

        Returns:
            what the restart found (``recovery``: rows lost, slots freed, seconds) and
            ``seconds``, the time from the old process's end to the new one serving.
        """
        with self._lock:
            if self._closed:
                raise StateError("restart_controller must be called on an open deployment")
            old = self._children[-1]
            old.proc.kill()
            old.proc.wait(timeout=10)
            started = time.monotonic()
            old.forget()
            settings = {**old.settings, "address": (old.info or old.settings)["address"]}
            new = self._children[-1] = Child(settings, self._start_method)
            await_ready([new], timeout)
            ctrl = self._controller("restart_controller")
            ctrl.attach_units([c.served for c in self._children[:-1]])
            info = {"recovery": ctrl.ping().recovery,
                    "seconds": time.monotonic() - started}
            self.restarts.append(info)
            logger.warning("the controller died and was restarted: %s", info)
            return info

    def restart_unit(self, i: int, timeout: float = START_TIMEOUT) -> dict[str, int]:
        """Replace storage unit ``i`` by a new, empty one at the same address.

        The old process is killed (if it still runs) and its segments removed; the
        controller drops the rows that lived there (``ControllerService.drop_unit``:
        counted as discarded, reason "unit_lost"). Clients reconnect by themselves.

        Returns:
            rows dropped per partition.
        """
        with self._lock:
            return self._restart_unit(i, timeout)

    def _restart_unit(self, i: int, timeout: float) -> dict[str, int]:
        if self._closed:
            raise StateError("restart_unit must be called on an open deployment")
        n = len(self._children) - 1
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
            raise ConfigError(f"i must be a unit index in [0, {n}), got {i!r}")
        old = self._children[i]
        old.proc.kill()
        old.proc.wait(timeout=10)
        # Lost before the new process serves at the same address: no row is placed
        # there meanwhile (it would be dropped with the old ones).
        ctrl = self._controller("restart_unit")
        dropped = ctrl.unit_lost(i)
        old.forget()
        from tq_stream.backends.shm import sweep_stale

        sweep_stale([old.pid])
        settings = {**old.settings, "address": (old.info or old.settings)["address"]}
        new = self._children[i] = Child(settings, self._start_method)  # (a start that
        await_ready([new], timeout)  # fails leaves it here: the next restart retries)
        for name, n in ctrl.drop_unit(i, new.served).items():  # also takes it back
            dropped[name] = dropped.get(name, 0) + n
        return dropped

    def _attached(self, what: str) -> RemoteBackend:
        """The backend ``attach`` gave (StateError naming ``what`` before that)."""
        if self._backend is None:
            raise StateError(f"{what} must be called on a deployment a stream is attached "
                             "to (tq.init attaches it), got one not attached yet")
        return self._backend

    def _controller(self, what: str) -> RemoteController:
        return self._attached(what).controller()

    def save(self, path: str) -> None:
        from tq_stream.deploy import snapshot

        backend = self._attached("save")
        snapshot.save(path, backend.controller(), backend.units())

    def close(self, grace: float = 5.0) -> None:
        if self._closed:
            return
        self._stop.set()
        if self._watch is not None and self._watch is not threading.current_thread():
            self._watch.join(timeout=START_TIMEOUT)
        with self._lock:
            self._closed = True
        if self._backend is not None:
            self._backend.close()
        for c in self._children:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for c in self._children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait(timeout=5)
            c.forget()
        from tq_stream.backends.shm import sweep_stale

        sweep_stale(self.pids)
        if self._ipc_dir:  # the unix sockets' folder goes with the deployment
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
        if self._ckpt_dir:  # so does a checkpoint folder it made
            shutil.rmtree(self._ckpt_dir, ignore_errors=True)
