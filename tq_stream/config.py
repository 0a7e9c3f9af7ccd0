"""Explicit configuration: frozen dataclasses with module-level defaults.

Nothing here reads environment variables; entry points pass values in.
"""

from __future__ import annotations

from dataclasses import dataclass

from tq_stream.errors import check_positive, check_timeout

DEFAULT_TIMEOUT = 60.0
DEFAULT_LEASE_TIMEOUT = 300.0
DEFAULT_PREFETCH = 2


@dataclass(frozen=True)
class StreamConfig:
    """Settings of a Stream handle.

    Attributes:
        timeout: default seconds any blocking call (get_meta, a put waiting for
            capacity, a remote call) waits before raising WaitTimeout.
        lease_timeout: default seconds a consumer holds rows before they are
            handed out again.
    """

    timeout: float = DEFAULT_TIMEOUT
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT

    def __post_init__(self) -> None:
        check_timeout("timeout", self.timeout)
        check_timeout("lease_timeout", self.lease_timeout)


def check_units(storage_units: object) -> int:
    return check_positive("storage_units", storage_units)
