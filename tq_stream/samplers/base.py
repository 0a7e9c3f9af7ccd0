"""The Sampler protocol: which ready rows form the next step.

A sampler is a pure function of candidate metadata (plus its own small state).
The controller calls ``sample(candidates, batch_size)`` with every row that is
ready for the task and not yet handed out, and receives the rows to hand out,
already split into one share per data-parallel rank, and the rows to discard.
Samplers never see tensor bytes.

Example:
    >>> class NewestFirst(Sampler):
    ...     def sample(self, candidates, batch_size):
    ...         need = batch_size * candidates.dp_size
    ...         if candidates.count < need:
    ...             return Selection.wait()
    ...         order = np.argsort(-candidates.ready_time, kind="stable")[:need]
    ...         return Selection.split(candidates.index[order], candidates.dp_size)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tq_stream.errors import ConfigError, check_positive

_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class Candidates:
    """Rows ready for a task and available to hand out, as aligned arrays.

    Attributes:
        index: int64 row indexes, oldest-ready first.
        ready_time: float64 ``time.time()`` at which each row became ready.
        dp_size: how many shares (data-parallel ranks) a step has.
        closed: True when the partition will receive no new rows.
        pending: rows not yet ready for the task that may still become ready.
        version: the consumer's current policy version (None if never set).
        turn_version: the highest version the consumer may hold when it reads this
            step (predicted for a step formed ahead of its turn; = ``version`` otherwise).
            A prediction: rows must not be discarded for it, only left out.
        step: the step number being selected.
        partition: the partition name.
    """

    index: np.ndarray
    ready_time: np.ndarray
    dp_size: int = 1
    closed: bool = False
    pending: int = 0
    version: int | None = None
    turn_version: int | None = None
    step: int = 0
    partition: str = ""
    _tags: Callable[[str, np.ndarray], np.ndarray] | None = field(default=None, repr=False)
    _has_tag: Callable[[str], bool] | None = field(default=None, repr=False)

    @property
    def count(self) -> int:
        return int(self.index.shape[0])

    def has_tag(self, name: str) -> bool:
        return self._has_tag is not None and self._has_tag(name)

    def tag(self, name: str, rows: np.ndarray | None = None) -> np.ndarray:
        """The tag ``name`` of every candidate (or of ``rows``, row indexes).

        A row without the tag reads as a missing value (see ``missing_mask``): NaN, or
        None in an object column. A tag no row has yet is all NaN. Declare the tags a
        sampler needs in ``required_tags`` and rows wait for them before they are ready.
        """
        rows = self.index if rows is None else rows
        if not self.has_tag(name):
            return np.full(len(rows), np.nan)
        assert self._tags is not None
        return self._tags(name, rows)

    def subset(self, positions: np.ndarray) -> Candidates:
        """The candidates at ``positions`` (a boolean mask or integer positions)."""
        return Candidates(
            index=self.index[positions],
            ready_time=self.ready_time[positions],
            dp_size=self.dp_size,
            closed=self.closed,
            pending=self.pending,
            version=self.version,
            turn_version=self.turn_version,
            step=self.step,
            partition=self.partition,
            _tags=self._tags,
            _has_tag=self._has_tag,
        )

    @staticmethod
    def from_arrays(
        index: np.ndarray,
        tags: Mapping[str, np.ndarray] | None = None,
        ready_time: np.ndarray | None = None,
        **kwargs: Any,
    ) -> Candidates:
        """Build candidates from plain arrays (tags aligned with ``index``); for tests.

        ``tags[name][i]`` is the tag of row ``index[i]``.
        """
        index = np.asarray(index, dtype=np.int64)
        tags = {k: np.asarray(v) for k, v in (tags or {}).items()}
        pos = {int(r): i for i, r in enumerate(index)}

        def lookup(name: str, rows: np.ndarray) -> np.ndarray:
            return tags[name][[pos[int(r)] for r in rows]]

        rt = np.arange(len(index), dtype=np.float64) if ready_time is None else ready_time
        return Candidates(
            index,
            np.asarray(rt, dtype=np.float64),
            _tags=lookup,
            _has_tag=tags.__contains__,
            **kwargs,
        )


@dataclass(frozen=True)
class Selection:
    """A sampler's answer.

    Attributes:
        shares: one int64 row-index array per data-parallel rank (all non-empty),
            or an empty tuple meaning "not enough rows yet: wait".
        discard: rows to drop for this task, by reason (counted in stats).
    """

    shares: tuple[np.ndarray, ...] = ()
    discard: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return bool(self.shares)

    @property
    def rows(self) -> np.ndarray:
        return np.concatenate(self.shares) if self.shares else _EMPTY

    @staticmethod
    def wait(discard: Mapping[str, np.ndarray] | None = None) -> Selection:
        return Selection((), dict(discard or {}))

    def with_discard(self, more: Mapping[str, np.ndarray]) -> Selection:
        """This selection with the rows of ``more`` added to its discards, by reason."""
        return Selection(self.shares, merge_discards(self.discard, more))

    @staticmethod
    def split(
        rows: np.ndarray, dp_size: int, discard: Mapping[str, np.ndarray] | None = None
    ) -> Selection:
        """Split ``rows`` into ``dp_size`` contiguous shares of equal length."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.shape[0] % dp_size:
            raise ConfigError(
                f"rows must split evenly over dp_size={dp_size}, got {rows.shape[0]} rows"
            )
        # One rank (the common case): the rows are its share, no np.split call.
        shares = (rows,) if dp_size == 1 else tuple(np.split(rows, dp_size))
        return Selection(shares, dict(discard or {}))


class Sampler:
    """Decides which candidate rows form a step. Subclass and override ``sample``.

    ``sample`` receives the per-rank ``batch_size``; a step hands out
    ``batch_size`` rows to each of ``candidates.dp_size`` ranks (a sampler may
    hand out fewer, never zero per rank). ``tail`` is called once the partition
    is closed and ``sample`` cannot fill a step any more: it may hand out a
    short final step or discard what is left.
    """

    _spec_args: tuple[tuple[Any, ...], dict[str, Any]]  # set by __new__, read by spec

    STATE_KEYS: tuple[str, ...] = ()
    inner: Sampler | None = None  # the sampler a wrapping one delegates to, if any
    group_tag: str | None = None  # the tag that groups rows, for a sampler that groups

    @property
    def prefix_ok(self) -> bool:
        """True if the sampler picks among the oldest candidates, so the controller may
        show it only a prefix of the ready queue first (much faster on large queues);
        when the prefix cannot fill a step the sampler is called with every candidate.
        False (the default) always shows every candidate."""
        return False

    def admission_limit(self, held: int, rows_per_version: int) -> int | None:
        """Rows producers may still start while ``held`` rows are admitted and not yet
        consumed, ``rows_per_version`` rows consumed per policy version (the controller
        paces ``Writer.reserve`` by it; ``controller/admission.py``). None (the
        default): no bound."""
        return None

    @property
    def version_bound(self) -> bool:
        """True if the sampler keeps rows within a bound of the consumer's version (a
        ``StalenessSampler``): a step formed before the consumer set a newer version is
        then checked with ``out_of_bound`` when its share is handed out. False (the
        default): a formed share is never checked again."""
        return False

    def out_of_bound(self, candidates: Candidates) -> np.ndarray:
        """A boolean mask over ``candidates`` (the rows of a formed share): the rows this
        sampler would not hand out at ``candidates.version``, a version the consumer
        set since the share was formed. The controller discards them (reason
        ``"stale"``) and re-forms the share. Default: none."""
        return np.zeros(candidates.count, dtype=bool)

    def __new__(cls, *args: Any, **kwargs: Any) -> Sampler:
        # The constructor arguments let a remote controller build the same sampler
        # (see tq_stream.samplers.spec); nothing else reads them.
        self = super().__new__(cls)
        self._spec_args = (args, kwargs)
        return self

    def sample(self, candidates: Candidates, batch_size: int) -> Selection:
        raise NotImplementedError

    def tail(self, candidates: Candidates, batch_size: int) -> Selection:
        """The final, short step of a closed partition: leftovers split evenly."""
        rows = candidates.index[: batch_size * candidates.dp_size]
        if rows.shape[0] < candidates.dp_size:
            return Selection.wait()
        return Selection(tuple(np.array_split(rows, candidates.dp_size)))

    def required_tags(self) -> tuple[str, ...]:
        """Tags this sampler reads: a row is ready for the task only once it has all of
        them (so a tag set later with ``stream.set_tags`` is waited for)."""
        return ()

    def check_batch(self, batch_size: int) -> None:
        """Raise ConfigError if this sampler can never form a step of ``batch_size``
        rows per rank (called when a dataset is built and a task registers)."""
        check_positive("batch_size", batch_size)
        if isinstance(self.inner, Sampler):  # a subclass may use the name for its own
            self.inner.check_batch(batch_size)

    def progress(self, candidates: Candidates, batch_size: int) -> str:
        """What a waiting step has and needs, for a timeout message."""
        if isinstance(self.inner, Sampler):  # a subclass may use the name for its own
            return self.inner.progress(candidates, batch_size)
        return (f"{candidates.count} rows ready, {batch_size * candidates.dp_size} needed "
                f"per step")

    def state_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.STATE_KEYS}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        check_state_keys(self, state, self.STATE_KEYS)
        for k in self.STATE_KEYS:
            setattr(self, k, state[k])


def check_state_keys(owner: object, state: Mapping[str, Any], keys: tuple[str, ...]) -> None:
    """Raise ConfigError unless ``state`` has exactly ``keys`` (strict loading)."""
    if not isinstance(state, Mapping) or set(state) != set(keys):
        got = sorted(state) if isinstance(state, Mapping) else state
        raise ConfigError(
            f"state for {type(owner).__name__} must have keys {sorted(keys)}, got {got!r}"
        )


def merge_discards(*parts: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Union of discard maps: rows of the same reason are concatenated; empty reasons dropped."""
    out: dict[str, list[np.ndarray]] = {}
    for part in parts:
        for reason, rows in part.items():
            if len(rows):
                out.setdefault(reason, []).append(np.asarray(rows, dtype=np.int64))
    return {r: v[0] if len(v) == 1 else np.concatenate(v) for r, v in out.items()}


def numeric_tag(values: np.ndarray, name: str) -> np.ndarray:
    """Int/float tag values as they are; bool/object ones as float64 (None -> NaN).

    Raises:
        ConfigError: if a value is not a number (e.g. a str in tag ``name``).
    """
    if values.dtype.kind in "iuf":
        return values
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"tag {name!r} must hold numbers, got {values[:3].tolist()!r}...") from e


def missing_mask(values: np.ndarray) -> np.ndarray:
    """True where a tag value is missing: NaN in a float column, None/NaN in an object column."""
    if values.dtype.kind == "f":
        nan: np.ndarray = np.isnan(values)
        return nan
    if values.dtype.kind == "O":
        return np.fromiter((v is None or v != v for v in values), bool, len(values))
    return np.zeros(values.shape[0], dtype=bool)


def check_sampler(sampler: object) -> Sampler:
    """Return ``sampler`` if it is a Sampler, or raise ConfigError naming it."""
    if not isinstance(sampler, Sampler):
        raise ConfigError(f"sampler must be a tq_stream.samplers.Sampler, got {sampler!r:.80}")
    return sampler
