"""The process-wide deployment behind the ``transfer_queue`` functions.

TransferQueue keeps one client per process: ``init(conf)`` in the driver starts
the controller and storage, ``init()`` anywhere else attaches to them. Here:

- ``init(conf)`` starts a tq_stream deployment: Ray mode when this process is in a
  Ray job (``ray.is_initialized()``), else embedded; ``conf.tq_stream.mode`` picks
  one explicitly (``embedded`` / ``local`` / ``ray``). A Ray deployment that already
  runs under the same name is attached to instead (TransferQueue does the same).
- ``init()`` with no ``conf`` attaches to the running deployment: in a Ray job by
  actor name, else at the address the starting process exported in
  ``TQ_STREAM_COMPAT_ADDRESS`` (inherited by the processes it spawns or forks). There
  ``init(conf)`` attaches too, as TransferQueue's does when a controller runs. With
  nothing running, ``init()`` starts one with the default settings, as TransferQueue
  does. An embedded deployment lives in its driver's memory and no other process can
  reach it: the driver exports its pid in ``TQ_STREAM_COMPAT_EMBEDDED_PID``, and
  ``init`` in another process (forked, which inherits a copy of the handle, or
  spawned) raises StateError instead of writing to a private copy the driver never sees.
- Every attached process follows the driver's settings (``settings.Shared``: polling
  mode, capacity, timeout; metrics endpoint): a Ray task or actor reads them from the
  controller actor it finds by name (the driver started it with them as annotations),
  a spawned or forked process from the environment it inherited. A ``conf`` it passes
  that contradicts them is a ConfigError; a value equal to the package default is no
  contradiction (the full default ``config.yaml``, unmerged, is accepted). A Ray
  deployment started by ``tq_stream.init`` itself has no such settings: a process
  attaching to it uses its own ``conf``'s (or the defaults).

verl's ``transfer_queue`` config node maps onto tq_stream as follows:

- ``backend.SimpleStorage.num_data_storage_units`` -> ``storage_units``;
- ``backend.SimpleStorage.total_storage_size`` -> the capacity (rows) of each
  partition, set by whichever process writes to it first (a put beyond it waits up to
  ``timeout`` for rows to be cleared, then raises ``WaitTimeout``). TransferQueue
  bounds all partitions together and raises at once; tq_stream bounds each one;
- ``metrics.enabled`` / ``metrics.port`` -> tq_stream's Prometheus endpoint
  (``tq_stream.metrics``: the metrics docs/grafana plots) on loopback, served by the
  driver (``get_metrics_endpoint`` in any attached process; needs the metrics extra);
- ``controller.polling_mode`` -> what the client's ``get_meta`` does with too few
  ready rows: return an empty BatchMeta at once (True) or wait up to ``timeout``;
- ``controller.sampler``: ``SequentialSampler`` only (any other is a ConfigError).
  Keys TransferQueue has and tq_stream does not use (``zmq_info``, other backends'
  sections) are ignored, so the package's ``config.yaml`` merged with an overlay works.

tq_stream's own settings live in an optional ``tq_stream`` node: ``mode``, ``name`` /
``namespace`` (of the Ray actors), ``timeout`` (of every blocking call) and
``start_timeout``, which bounds how long a Ray deployment may take to start: its
actors ask for no CPU, so a cluster advertising fewer CPUs than units + 1 still
places them, and past the bound ``init`` raises ``WaitTimeout`` instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from tq_stream.compat.settings import (
    DEFAULTS,
    RAY_NAME,
    RAY_NAMESPACE,
    Shared,
    clear_exported,
    merge,
    settings,
    to_plain,
)
from tq_stream.compat.variants import Schemas
from tq_stream.config import StreamConfig
from tq_stream.errors import StateError, WaitTimeout

if TYPE_CHECKING:
    from tq_stream.client import Client
    from tq_stream.stream import Stream

ADDRESS_ENV = "TQ_STREAM_COMPAT_ADDRESS"
EMBEDDED_ENV = "TQ_STREAM_COMPAT_EMBEDDED_PID"  # set by a driver whose deployment is embedded
MAX_THREADS = 16  # blocking calls that async callers may have in flight at once
ATTACH_TIMEOUT = 60.0  # seconds init() waits for a Ray deployment that is starting


def _split_message(pid: int) -> str:
    return (f"transfer_queue.init() in process {os.getpid()} cannot reach the driver's "
            f"deployment: it is embedded in process {pid} (in its memory, visible to no other "
            f"process), so this process would write to a private copy. Start the driver with "
            f"conf tq_stream.mode: local (or inside a Ray job, mode ray)")


def _check_not_split() -> None:
    """Raise StateError in a process whose driver runs an embedded deployment (item 4 of
    issue 21: its puts would go to a private copy the driver never sees)."""
    pid = os.environ.get(EMBEDDED_ENV)
    if pid and pid != str(os.getpid()) and not os.environ.get(ADDRESS_ENV) \
            and not _ray_running():
        raise StateError(_split_message(int(pid)))


def _ray_running() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def _stream_config(shared: Shared | None) -> StreamConfig:
    return StreamConfig() if shared is None else StreamConfig(timeout=shared.timeout)


_P = ParamSpec("_P")
_T = TypeVar("_T")

class Runtime:
    """This process's handle on the deployment (one per process, see module doc)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.stream: Stream | None = None
        self.conf: dict[str, Any] | None = None
        self.capacity: int | None = None
        self.polling = False
        self.schemas = Schemas()
        # (partition, task) -> (data_fields, batch_size, physical fields) of get_meta
        self.tasks: dict[tuple[str, str], tuple[tuple[str, ...], int, tuple[str, ...]]] = {}
        self.task_names: dict[tuple[str, str], frozenset[str]] = {}  # stored names then
        self._client: Client | None = None
        self.owner = False
        self.pid = os.getpid()  # the process this runtime's handle belongs to
        self.partitions: set[str] = set()
        self.metrics: Any = None  # tq_stream.metrics.server.MetricsServer, in the driver
        self.shared: Shared | None = None  # the settings an attached process follows
        self._executor: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ lifecycle
    def init(self, conf: object = None) -> dict[str, Any] | None:
        with self.lock:
            if self.stream is not None and self.pid != os.getpid():
                self._forked()
            if self.stream is not None:
                return self.conf if conf is None else to_plain(conf)
            _check_not_split()
            plain = to_plain(conf)
            if conf is None and self._attach(ATTACH_TIMEOUT):
                return None
            if conf is not None and not _ray_running() and self._attach_address(plain):
                return plain  # a worker of a local driver: its deployment, its settings
            merged = merge(DEFAULTS, plain)
            opts = settings(merged)
            mode = opts["mode"] or ("ray" if _ray_running() else "embedded")
            if opts["metrics"]:
                from tq_stream.metrics import check_port, require_prometheus

                require_prometheus()  # fail before starting anything
                check_port(opts["port"])
            own = Shared.of(opts, mode, None)
            if mode == "ray" and self._attach_ray(opts["name"], opts["namespace"], 0.0, plain,
                                                  own):
                return plain
            self._start(mode, opts, own)
            self.conf, self.capacity, self.polling = merged, opts["capacity"], opts["polling"]
            endpoint = None
            if opts["metrics"]:
                endpoint = merged["metrics"]["endpoint"] = self._serve_metrics(opts["port"])
            if mode != "embedded":  # reachable from other processes: they follow these
                Shared.of(opts, mode, endpoint).export()
            return merged

    def _serve_metrics(self, port: int) -> str:
        """Serve the deployment's Prometheus metrics (tq_stream's full set, the one
        docs/grafana plots) from this process; returns the endpoint."""
        from tq_stream.metrics import serve

        assert self.stream is not None  # served once the stream is open
        try:
            self.metrics = serve(self.stream.connection, port)
        except BaseException:
            self.close()
            raise
        return str(self.metrics.endpoint)

    def _start(self, mode: str, opts: dict[str, Any], shared: Shared) -> None:
        import tq_stream

        config = StreamConfig(timeout=opts["timeout"])
        extra: dict[str, Any] = {}
        if mode == "ray":  # every Ray process that finds it by name reads ``shared``
            extra = {"name": opts["name"], "namespace": opts["namespace"],
                     "start_timeout": opts["start_timeout"],
                     "annotations": shared.annotation()}
        try:
            self.stream = tq_stream.init(mode=mode, storage_units=opts["units"],
                                         config=config, **extra)
        except Exception as exc:
            if mode != "ray" or "GetTimeoutError" not in type(exc).__name__:
                raise
            raise WaitTimeout(
                f"Ray did not start the {opts['units']} storage units and the controller "
                f"within tq_stream.start_timeout={opts['start_timeout']}s (they ask for no "
                f"CPU, but Ray starts worker processes about num_cpus at a time); raise "
                f"start_timeout or lower backend.SimpleStorage.num_data_storage_units"
            ) from exc
        self.owner = True
        self.pid = os.getpid()
        if self.stream.address is not None:
            os.environ[ADDRESS_ENV] = self.stream.address
        elif mode == "embedded":
            os.environ[EMBEDDED_ENV] = str(self.pid)

    def _forked(self) -> None:
        """A forked child inherited this runtime: an embedded deployment is a copy (refused);
        a local or Ray one is attached to again from this process."""
        stream, self.stream = self.stream, None
        assert stream is not None  # called for an inherited stream only
        self.owner, self._client, self._executor, self.metrics = False, None, None, None
        self.tasks.clear()
        self.task_names.clear()
        if stream.mode == "embedded":
            raise StateError(_split_message(self.pid))
        self.pid = os.getpid()
        if not self._attach(ATTACH_TIMEOUT):
            raise StateError(f"transfer_queue.init() in forked process {os.getpid()} found no "
                             f"deployment to attach to ({ADDRESS_ENV} is not set)")

    def _attach(self, wait: float) -> bool:
        """Connect to the running deployment (in a Ray job: waiting up to ``wait`` s for
        it to appear); False when there is none."""
        if _ray_running():
            return self._attach_ray(RAY_NAME, RAY_NAMESPACE, wait)
        return self._attach_address({})

    def _attach_address(self, conf: dict[str, Any]) -> bool:
        """Connect to the local deployment whose driver started this process (the address
        it exported), with the settings it exported; False when there is none.

        Raises:
            ConfigError: ``conf`` (this process's own) contradicts the driver's settings.
        """
        address = os.environ.get(ADDRESS_ENV)
        if not address:
            return False
        import tq_stream

        shared = Shared.inherited()
        if shared is not None:
            shared.check(conf)
        self.stream = tq_stream.connect(address, config=_stream_config(shared))
        self._follow(shared)
        return True

    def _attach_ray(self, name: str, namespace: str, wait: float,
                    conf: dict[str, Any] | None = None, own: Shared | None = None) -> bool:
        """Connect to the Ray deployment ``name`` (waiting up to ``wait`` s for it), with
        the settings its driver annotated it with (else ``own``, this process's).

        Raises:
            ConfigError: ``conf`` (this process's own) contradicts the driver's settings.
        """
        import ray

        import tq_stream
        from tq_stream.deploy.ray_actor import controller_info

        deadline = time.monotonic() + wait
        while True:
            try:
                ray.get_actor(f"{name}_controller", namespace=namespace)
                break
            except ValueError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.2)
        shared = Shared.annotated(controller_info(name, namespace).get("annotations", {}))
        if shared is not None:
            shared.check(conf or {})
        shared = shared or own
        self.stream = tq_stream.connect(name=name, namespace=namespace,
                                        config=_stream_config(shared))
        self._follow(shared)
        return True

    def _follow(self, shared: Shared | None) -> None:
        """Take ``shared`` (the driver's settings; None: the defaults) in this process."""
        self.pid = os.getpid()
        self.shared = shared
        if shared is not None:
            self.polling, self.capacity = shared.polling, shared.capacity

    def metrics_endpoint(self) -> str | None:
        """Where the deployment's metrics are served: by this process, or by the driver
        this process attached to."""
        if self.metrics is not None:
            return str(self.metrics.endpoint)
        return None if self.shared is None else self.shared.metrics_endpoint

    def close(self) -> None:
        with self.lock:
            stream, self.stream = self.stream, None
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
            if self.owner and os.environ.get(ADDRESS_ENV) == getattr(stream, "address", None):
                os.environ.pop(ADDRESS_ENV, None)
                clear_exported()
            if self.owner and os.environ.get(EMBEDDED_ENV) == str(self.pid):
                os.environ.pop(EMBEDDED_ENV, None)
            self.owner, self.conf, self.capacity, self.polling = False, None, None, False
            self.shared = None
            self.partitions.clear()
            self.schemas.clear()
            self.tasks.clear()
            self.task_names.clear()
            self._client = None
            if self._executor is not None:
                self._executor.shutdown(wait=False)
                self._executor = None
            if stream is not None:
                stream.close()

    def get(self, auto: bool = True) -> Stream:
        """The Stream; with none yet and ``auto``, attach to a running deployment (as
        TransferQueue's functions do), never start one behind the caller's back.

        Raises:
            StateError: no deployment to use: call ``tq.init(conf)`` first.
        """
        stream = self.stream
        if stream is not None and self.pid != os.getpid():  # a forked child's copy
            with self.lock:
                if self.stream is not None and self.pid != os.getpid():
                    self._forked()
                stream = self.stream
        if stream is None:
            with self.lock:
                if self.stream is None and not (auto and self._attach(0.0)):
                    raise StateError("transfer_queue must be initialized first: call "
                                     "tq.init(conf) (found no running deployment)")
                stream = self.stream
        assert stream is not None  # attached above
        return stream

    # -------------------------------------------------------------- helpers
    def native_client(self) -> Client:
        """This process's tq_stream ``Client`` (one consumer session) for get_meta."""
        stream = self.get()
        with self.lock:
            if self._client is None:
                self._client = stream.client()
            return self._client

    def ensure_partition(self, partition: str) -> None:
        """Create ``partition`` with the configured capacity before its first put."""
        if partition in self.partitions:
            return
        if self.capacity is not None:  # any process: the first to write may be a worker
            self.get().create_partition(partition, capacity=self.capacity)
        self.partitions.add(partition)

    async def run(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """Run the blocking ``fn`` in a bounded thread pool, off the caller's event loop."""
        with self.lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="tq_compat")
            executor = self._executor
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(executor, call)


RUNTIME = Runtime()
