"""TaskConfig: what every rank of a consumer task must agree on, checked once.

``register_task``'s settings (the partition, the task's name and its sampler
aside) as one frozen value: every rank registers the same one, a restored task is
registered again with its checkpointed one, and checkpoints and the ack journal
carry it as a plain dict (``to_dict`` / ``from_dict``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tq_stream.errors import ConfigError, check_positive, check_timeout

MAX_REPLICAS = 62  # replica bits fit an int64
DEFAULT_LEASE_TIMEOUT = 300.0  # seconds a claim lasts without a renewal


def check_replicas(replicas: object) -> int:
    """``replicas`` if it is an int in [1, MAX_REPLICAS], else ConfigError."""
    check_positive("replicas", replicas)
    if replicas > MAX_REPLICAS:  # type: ignore[operator]
        raise ConfigError(f"replicas must be <= {MAX_REPLICAS}, got {replicas!r}")
    return replicas  # type: ignore[return-value]


@dataclass(frozen=True)
class TaskConfig:
    """What every rank of a task must agree on."""

    fields: tuple[str, ...]
    batch_size: int
    dp_size: int = 1
    replicas: int = 1
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT
    drop_last: bool = False

    @classmethod
    def checked(cls, fields: Sequence[str], batch_size: int, dp_size: int = 1,
                replicas: int = 1, lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
                drop_last: bool = False) -> TaskConfig:
        """The config of these settings; ConfigError naming the first bad one."""
        if not fields or any(not isinstance(f, str) for f in fields):
            raise ConfigError(f"fields must be a non-empty list of str, got {fields!r}")
        return cls(tuple(fields), check_positive("batch_size", batch_size),
                   check_positive("dp_size", dp_size), check_replicas(replicas),
                   check_timeout("lease_timeout", lease_timeout), bool(drop_last))

    def to_dict(self) -> dict[str, Any]:
        """As ``register_task``'s keyword arguments (``fields`` a list)."""
        return {"fields": list(self.fields), "batch_size": self.batch_size,
                "dp_size": self.dp_size, "replicas": self.replicas,
                "lease_timeout": self.lease_timeout, "drop_last": self.drop_last}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TaskConfig:
        """The config ``to_dict`` gave (a checkpoint's: trusted, not checked again)."""
        return cls(tuple(d["fields"]), **{k: v for k, v in d.items() if k != "fields"})
