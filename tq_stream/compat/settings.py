"""A ``transfer_queue`` config (TransferQueue 0.1.11's keys) as tq_stream's options, and
the options every process of one deployment must share.

``settings(merge(DEFAULTS, to_plain(conf)))`` validates a config and returns the options
``Runtime`` uses (see ``runtime``'s module docstring for what each key does).

TransferQueue keeps the config in its controller, so every client follows the driver's:
its polling mode is the controller's. Here the driver's ``Shared`` options (polling
mode, capacity, units, timeout, mode, metrics endpoint), as JSON text, travel two ways:

- a Ray deployment carries them in its controller actor's ``annotations`` (key
  ``ANNOTATION``), so every Ray task or actor, on any node, that finds the deployment
  by name takes them (``Shared.annotated``);
- the process that starts a local (or Ray) deployment exports them beside its address,
  in ``TQ_STREAM_COMPAT_SETTINGS``, for the processes it spawns or forks, which inherit
  the environment (``Shared.inherited``).

A ``conf`` that an attaching process passes may repeat them but not contradict them
(``Shared.check``): only a value that differs from the driver's and from the package
default counts, so a worker that passes the full default ``config.yaml`` unmerged is
not refused for the defaults it carries.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from tq_stream.errors import ConfigError

SETTINGS_ENV = "TQ_STREAM_COMPAT_SETTINGS"
ANNOTATION = "tq_stream.compat.settings"  # the Ray controller's annotation holding them
RAY_NAME = "tq_stream_compat"
RAY_NAMESPACE = "transfer_queue"
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


def to_plain(conf: object) -> dict[str, Any]:
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
    return {"polling": polling, "units": units, "capacity": size, "mode": mode,
            "name": own.get("name", RAY_NAME), "namespace": own.get("namespace", RAY_NAMESPACE),
            "timeout": float(own.get("timeout", 60.0)),
            "start_timeout": float(own.get("start_timeout", 300.0)),
            "metrics": bool(metrics.get("enabled", False)), "port": int(metrics.get("port", 0))}


# Shared field -> (the config key a conf sets it with, the ``settings`` option it is)
KEYS = {
    "polling": ("controller.polling_mode", "polling"),
    "capacity": ("backend.SimpleStorage.total_storage_size", "capacity"),
    "units": ("backend.SimpleStorage.num_data_storage_units", "units"),
    "timeout": ("tq_stream.timeout", "timeout"),
    "mode": ("tq_stream.mode", "mode"),
}


@dataclass(frozen=True)
class Shared:
    """The options of a running deployment that every process attached to it follows."""

    polling: bool
    capacity: int | None
    units: int
    timeout: float
    mode: str
    metrics_endpoint: str | None = None

    @classmethod
    def of(cls, opts: dict[str, Any], mode: str, endpoint: str | None) -> Shared:
        return cls(opts["polling"], opts["capacity"], opts["units"], opts["timeout"], mode,
                   endpoint)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str, where: str) -> Shared:
        """The options ``to_json`` wrote, read from ``where`` (named in the ConfigError)."""
        try:
            return cls(**json.loads(text))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{where} must hold the JSON tq_stream.compat writes, "
                              f"got {text!r}") from exc

    def export(self) -> None:
        """Publish these options to the processes this one starts from now on."""
        os.environ[SETTINGS_ENV] = self.to_json()

    def annotation(self) -> dict[str, str]:
        """These options as the annotations of a Ray deployment."""
        return {ANNOTATION: self.to_json()}

    @classmethod
    def inherited(cls) -> Shared | None:
        """The options the process that started the deployment exported, if any."""
        text = os.environ.get(SETTINGS_ENV)
        return cls.from_json(text, SETTINGS_ENV) if text else None

    @classmethod
    def annotated(cls, annotations: Mapping[str, str]) -> Shared | None:
        """The options a Ray deployment's driver annotated it with, if any (none when
        it was started by ``tq_stream.init`` itself, not through ``transfer_queue``)."""
        text = annotations.get(ANNOTATION)
        return cls.from_json(text, f"annotation {ANNOTATION!r}") if text else None

    def check(self, conf: dict[str, Any]) -> None:
        """Raise ConfigError if ``conf`` (a plain config) sets a shared option otherwise.

        A value equal to the package default does not count: it may come from the
        default ``config.yaml`` the process loaded unmerged, not from its own choice.
        """
        opts = settings(merge(DEFAULTS, conf))
        mine = asdict(self)
        for field, (path, opt) in KEYS.items():
            if _has(conf, path) and opts[opt] not in (mine[field], DEFAULT_SETTINGS[opt]):
                raise ConfigError(
                    f"{path} must be {mine[field]!r} in this process: it attaches to the "
                    f"running {self.mode} deployment, whose driver set it (every process "
                    f"follows the driver's, as under TransferQueue), got {opts[opt]!r}; leave "
                    f"it out of this process's conf")


DEFAULT_SETTINGS = settings(DEFAULTS)


def _has(conf: Mapping[str, Any], path: str) -> bool:
    """True if ``conf`` sets ``path`` (``tq_stream.mode: null`` means "pick one": unset)."""
    node: Any = conf
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return not (path == KEYS["mode"][0] and node is None)


def clear_exported() -> None:
    os.environ.pop(SETTINGS_ENV, None)
