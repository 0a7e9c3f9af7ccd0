"""The protocols of a connection: what the client layers (Stream, Writer, Client, KV) call
on a controller (``ControllerAPI``), and what a ``Connection`` needs of the way it reaches
a deployment (``Backend``: in process, or over sockets).

Both the in-process ``Controller`` (embedded mode) and ``RemoteController`` (its
RPC stand-in in local and Ray mode) provide these methods with these keyword
arguments; the client layers are typed against this protocol, not against either.
Row indices and generations are int64 numpy arrays; placements and metas are typed
replies (``tq_stream.messages``; a client builds its ``BatchMeta`` with
``BatchMeta.from_reply``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from tq_stream.backends.base import StorageUnit
from tq_stream.messages.media import MediaHeld, MediaPlace
from tq_stream.messages.puts import Committed, Placement
from tq_stream.messages.reads import Found, Located, Resume, StepMeta, TagColumns, TaskRows
from tq_stream.stats import PartitionStats

if TYPE_CHECKING:
    from tq_stream.connection.spares import SparePool
    from tq_stream.samplers.base import Sampler


@runtime_checkable
class ControllerAPI(Protocol):
    """The controller methods the client layers use (see module docstring)."""

    def create_partition(self, partition: str, capacity: int | None = None,
                         consumers: Sequence[str] | None = None,
                         spills: bool = False) -> None: ...

    def close_partition(self, partition: str) -> None: ...

    def reserve(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                unit: int = -1, timeout: float = 60.0, expect: Any = None,
                spare: int = 0, session: str = "", lease: float = ...,
                holder: Mapping[str, Any] | None = None,
                blocked: float = 0.0) -> Placement: ...

    def commit(self, partition: str, index: np.ndarray, generation: np.ndarray,
               schemas: Mapping[str, Any], tags: list[dict[str, Any]] | None = None,
               holder: Mapping[str, Any] | None = None,
               shared: Sequence[str | None] | None = None) -> None: ...

    def reserve_shared(self, partition: str, keys: Sequence[str], schemas: Mapping[str, Any],
                       digests: Sequence[Mapping[str, str]], nbytes: Sequence[int],
                       unit: int = -1,
                       timeout: float = 60.0, session: str = "",
                       lease: float = ...) -> Placement: ...

    def abort(self, partition: str, index: np.ndarray, generation: np.ndarray) -> None: ...

    def commit_new(self, partition: str, keys: Sequence[str], index: Sequence[int],
                   generation: Sequence[int], schemas: Mapping[str, Any],
                   tags: list[dict[str, Any]] | None = None, unit: int = -1,
                   spare: int = 0) -> Committed: ...

    def release_spares(self, partition: str, index: np.ndarray,
                       generation: np.ndarray) -> int: ...

    def media_hold(self, partition: str, keys: Sequence[str], session: str, holder: str,
                   lease: float, producer: bool, pending: float = 0.0,
                   pins: Sequence[str] | None = None) -> MediaHeld: ...

    def media_release(self, partition: str, pin: str, session: str, holder: str) -> None: ...

    def media_lookup(self, partition: str, key: str, index: int, generation: int, pin: str,
                     deployment: str, fields: Sequence[str]) -> MediaPlace: ...

    def admit(self, partition: str, n: int, timeout: float = 60.0) -> int: ...

    def register_task(self, partition: str, task: str, fields: Sequence[str], batch_size: int,
                      dp_size: int = 1, replicas: int = 1, lease_timeout: float = 300.0,
                      drop_last: bool = False, sampler: Sampler | None = None) -> None: ...

    def get_meta(self, partition: str, task: str, step: int | None = None, dp_rank: int = 0,
                 timeout: float = 60.0, replica: int | None = None, session: str = "",
                 consumer: str = "") -> StepMeta | None: ...

    def ack(self, partition: str, task: str, step: int, dp_rank: int, index: np.ndarray,
            generation: np.ndarray, replica: int = 0, session: str = "") -> int: ...

    def release(self, partition: str, task: str, step: int, dp_rank: int, index: np.ndarray,
                generation: np.ndarray, replica: int = 0, session: str = "") -> None: ...

    def renew(self, partition: str, task: str, step: int | None = None,
              session: str = "") -> int: ...

    def first_unfinished(self, partition: str, task: str, dp_rank: int = 0,
                         replica: int | None = None) -> Resume: ...

    def cancel(self, session: str) -> None: ...

    def task_rows(self, partition: str, task: str) -> TaskRows: ...

    def clear(self, partition: str, keys: Sequence[str] | None = None) -> int: ...

    def lookup(self, partition: str, keys: Sequence[str],
               fields: Sequence[str] | None = ()) -> Found: ...

    def locate(self, partition: str, keys: Sequence[str]) -> Located: ...

    def list_rows(self, partition: str,
                  keys: Sequence[str] | None = None) -> list[dict[str, Any]]: ...

    def list_tags(self, partition: str) -> TagColumns: ...

    def keys_of(self, partition: str, index: Sequence[int]) -> list[str]: ...

    def partitions(self) -> list[str]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def set_tags(self, partition: str, keys: Sequence[str],
                 tags: list[dict[str, Any]]) -> None: ...

    def set_version(self, partition: str, task: str, version: int,
                    at_step: int | None = None) -> None: ...

    def reading(self, partition: str, task: str, step: int) -> None: ...

    def set_admission(self, partition: str, task: str, steps_per_version: int) -> None: ...

    def stats(self) -> dict[str, PartitionStats]: ...


class Backend(Protocol):
    """How a ``Connection`` reaches a deployment: ``EmbeddedBackend`` (the objects in this
    process) or ``RemoteBackend`` (clients of the servers, made lazily). A backend that
    can be reopened in another process pickles to what it needs for that (never an
    owner's token); one that cannot refuses pickling with a StateError."""

    @property
    def address(self) -> str | None:
        """Where ``tq.connect`` reaches the deployment (None in process)."""
        ...

    @property
    def curve_server_key(self) -> bytes | None:
        """The deployment's CURVE public key (None without CURVE)."""
        ...

    def controller(self) -> ControllerAPI: ...

    def units(self) -> list[StorageUnit]: ...

    def spares(self, partition: str, unit: int) -> SparePool | None:
        """This process's spare rows for puts to ``partition`` (None: puts reserve)."""
        ...

    def preferred_unit(self) -> int:
        """The unit writers of this process use by default (-1: spread over all)."""
        ...

    def close(self) -> None: ...


class Owner(Protocol):
    """What a ``Stream`` that owns its deployment (or its sockets) calls at its end."""

    def save(self, path: str) -> None: ...

    def close(self) -> None: ...
