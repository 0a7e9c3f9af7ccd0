"""The process-wide deployment behind the ``transfer_queue`` functions.

TransferQueue keeps one client per process: ``init(conf)`` in the driver starts
the controller and storage, ``init()`` anywhere else attaches to them. Here:

- ``init(conf)`` starts a tq_stream deployment: Ray mode when this process is in a
  Ray job (``ray.is_initialized()``), else embedded; ``conf.tq_stream.mode`` picks
  one explicitly (``embedded`` / ``local`` / ``ray``). A Ray deployment that already
  runs under the same name is attached to instead (TransferQueue does the same).
- ``init()`` with no ``conf`` attaches to the running deployment: in a Ray job by
  actor name, else at the address the starting process exported in
  ``TQ_STREAM_COMPAT_ADDRESS`` (inherited by the processes it spawns). With nothing
  running, it starts one with the default settings, as TransferQueue does. An
  embedded deployment lives in its driver's memory and no other process can reach
  it: the driver exports its pid in ``TQ_STREAM_COMPAT_EMBEDDED_PID``, and ``init()``
  in another process (forked, which inherits a copy of the handle, or spawned) raises
  StateError instead of writing to a private copy the driver never sees.

verl's ``transfer_queue`` config node maps onto tq_stream as follows:

- ``backend.SimpleStorage.num_data_storage_units`` -> ``storage_units``;
- ``backend.SimpleStorage.total_storage_size`` -> the capacity (rows) of each
  partition the starting process creates (a put beyond it waits up to ``timeout``
  for rows to be cleared, then raises ``WaitTimeout``);
- ``metrics.enabled`` / ``metrics.port`` -> a Prometheus text endpoint of
  ``stream.stats()`` on loopback (``get_metrics_endpoint``);
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
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tq_stream.compat.variants import Schemas
from tq_stream.config import StreamConfig
from tq_stream.errors import ConfigError, StateError, WaitTimeout

if TYPE_CHECKING:
    from tq_stream.client import Client

ADDRESS_ENV = "TQ_STREAM_COMPAT_ADDRESS"
EMBEDDED_ENV = "TQ_STREAM_COMPAT_EMBEDDED_PID"  # set by a driver whose deployment is embedded
RAY_NAME = "tq_stream_compat"
RAY_NAMESPACE = "transfer_queue"
MAX_THREADS = 16  # blocking calls that async callers may have in flight at once
ATTACH_TIMEOUT = 60.0  # seconds init() waits for a Ray deployment that is starting
MODES = ("embedded", "local", "ray")
BACKENDS = ("SimpleStorage",)
SAMPLERS = ("SequentialSampler",)

DEFAULTS: dict[str, Any] = {
    "metrics": {"enabled": False, "port": 0},
    "controller": {"sampler": "SequentialSampler", "polling_mode": False},
    "backend": {"storage_backend": "SimpleStorage",
                "SimpleStorage": {"total_storage_size": None, "num_data_storage_units": 2}},
    "tq_stream": {"mode": None, "name": RAY_NAME, "namespace": RAY_NAMESPACE,
                  "timeout": 60.0, "start_timeout": 300.0},
}


def to_plain(conf: Any) -> dict[str, Any]:
    """A DictConfig (or any mapping) as nested plain dicts."""
    if conf is None:
        return {}
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(conf, DictConfig):
            return OmegaConf.to_container(conf, resolve=True)  # type: ignore[return-value]
    except ImportError:
        pass
    if not isinstance(conf, Mapping):
        raise ConfigError(f"conf must be a DictConfig or a dict, got {type(conf).__name__}")
    return {k: to_plain(v) if isinstance(v, Mapping) else v for k, v in conf.items()}


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def settings(conf: dict[str, Any]) -> dict[str, Any]:
    """tq_stream's options from a merged ``transfer_queue`` config (ConfigError if bad)."""
    backend = conf.get("backend") or {}
    name = backend.get("storage_backend", "SimpleStorage")
    if name not in BACKENDS:
        raise ConfigError(f"backend.storage_backend must be one of {BACKENDS} (tq_stream keeps "
                          f"rows in its own storage units), got {name!r}")
    simple = backend.get("SimpleStorage") or {}
    units = simple.get("num_data_storage_units", 2)
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise ConfigError(f"backend.SimpleStorage.num_data_storage_units must be an int >= 1, "
                          f"got {units!r}")
    size = simple.get("total_storage_size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConfigError(f"backend.SimpleStorage.total_storage_size must be None or an int "
                          f">= 1, got {size!r}")
    own = conf.get("tq_stream") or {}
    mode = own.get("mode")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"tq_stream.mode must be one of {MODES} or None, got {mode!r}")
    controller = conf.get("controller") or {}
    sampler = controller.get("sampler", "SequentialSampler")
    if sampler not in SAMPLERS:
        raise ConfigError(f"controller.sampler must be one of {SAMPLERS} under tq_stream.compat "
                          f"(use tq_stream's own samplers through tq_stream.compat.stream()), "
                          f"got {sampler!r}")
    polling = controller.get("polling_mode", False)
    if not isinstance(polling, bool):
        raise ConfigError(f"controller.polling_mode must be a bool, got {polling!r}")
    metrics = conf.get("metrics") or {}
    return {"polling": polling,"units": units, "capacity": size, "mode": mode,
            "name": own.get("name", RAY_NAME), "namespace": own.get("namespace", RAY_NAMESPACE),
            "timeout": float(own.get("timeout", 60.0)),
            "start_timeout": float(own.get("start_timeout", 300.0)),
            "metrics": bool(metrics.get("enabled", False)), "port": int(metrics.get("port", 0))}


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


class Runtime:
    """This process's handle on the deployment (one per process, see module doc)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.stream: Any = None
        self.conf: dict[str, Any] | None = None
        self.capacity: int | None = None
        self.polling = False
        self.schemas = Schemas()
        # (partition, task) -> (data_fields, batch_size, physical fields) of get_meta
        self.tasks: dict[tuple[str, str], tuple[tuple[str, ...], int, tuple[str, ...]]] = {}
        self.task_names: dict[tuple[str, str], frozenset[str]] = {}  # stored names then
        self._client: Any = None
        self.owner = False
        self.pid = os.getpid()  # the process this runtime's handle belongs to
        self.partitions: set[str] = set()
        self.metrics: Any = None
        self._executor: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------ lifecycle
    def init(self, conf: Any = None) -> dict[str, Any] | None:
        with self.lock:
            if self.stream is not None and self.pid != os.getpid():
                self._forked()
            if conf is None and self.stream is None:
                _check_not_split()
            if self.stream is not None:
                return self.conf if conf is None else to_plain(conf)
            if conf is None and self._attach(ATTACH_TIMEOUT):
                return None
            merged = merge(DEFAULTS, to_plain(conf))
            opts = settings(merged)
            mode = opts["mode"] or ("ray" if _ray_running() else "embedded")
            if mode == "ray" and self._attach_ray(opts["name"], opts["namespace"], 0.0):
                self.polling = opts["polling"]
                return to_plain(conf)
            self._start(mode, opts)
            self.conf, self.capacity, self.polling = merged, opts["capacity"], opts["polling"]
            if opts["metrics"]:
                from tq_stream.compat.metrics import MetricsServer

                self.metrics = MetricsServer(self.stream, opts["port"])
                merged["metrics"]["endpoint"] = self.metrics.endpoint
            return merged

    def _start(self, mode: str, opts: dict[str, Any]) -> None:
        import tq_stream

        config = StreamConfig(timeout=opts["timeout"])
        extra: dict[str, Any] = {}
        if mode == "ray":
            extra = {"name": opts["name"], "namespace": opts["namespace"],
                     "start_timeout": opts["start_timeout"]}
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
        self.owner, self._client, self._executor = False, None, None
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
        address = os.environ.get(ADDRESS_ENV)
        if not address:
            return False
        import tq_stream

        self.stream = tq_stream.connect(address)
        self.pid = os.getpid()
        return True

    def _attach_ray(self, name: str, namespace: str, wait: float) -> bool:
        """Connect to the Ray deployment ``name`` (waiting up to ``wait`` s for it)."""
        import ray

        import tq_stream

        deadline = time.monotonic() + wait
        while True:
            try:
                ray.get_actor(f"{name}_controller", namespace=namespace)
                break
            except ValueError:
                if time.monotonic() >= deadline:
                    return False
                time.sleep(0.2)
        self.stream = tq_stream.connect(name=name, namespace=namespace)
        return True

    def close(self) -> None:
        with self.lock:
            stream, self.stream = self.stream, None
            if self.metrics is not None:
                self.metrics.close()
                self.metrics = None
            if self.owner and os.environ.get(ADDRESS_ENV) == getattr(stream, "address", None):
                os.environ.pop(ADDRESS_ENV, None)
            if self.owner and os.environ.get(EMBEDDED_ENV) == str(self.pid):
                os.environ.pop(EMBEDDED_ENV, None)
            self.owner, self.conf, self.capacity, self.polling = False, None, None, False
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

    def get(self, auto: bool = True) -> Any:
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
        if self.owner and self.capacity is not None:
            self.get().create_partition(partition, capacity=self.capacity)
        self.partitions.add(partition)

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the blocking ``fn`` in a bounded thread pool, off the caller's event loop."""
        with self.lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(MAX_THREADS, thread_name_prefix="tq_compat")
            executor = self._executor
        call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(executor, call)


RUNTIME = Runtime()
