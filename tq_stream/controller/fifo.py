"""ReadyQueue: the rows available to one task, oldest-ready first.

Rows are appended when they become available (all of the task's fields
written) and are removed lazily: an entry is valid while ``avail[row]`` is set
and ``seq[row]`` still equals the entry's sequence number, so a row leased and
later returned is valid only at its newest position. Returned rows go to a
separate front list so they are handed out before younger rows.
"""

from __future__ import annotations

import numpy as np

_MIN = 1024


class ReadyQueue:
    """Lazy-deletion FIFO of row indexes over a shared ``avail`` mask.

    Invariant: every row with ``avail[row]`` has exactly one valid entry, in
    ``front`` or ``rows[head:tail]``; ``count == avail.sum()``.
    """

    def __init__(self, size: int) -> None:
        self.avail = np.zeros(size, dtype=bool)
        self.seq = np.zeros(size, dtype=np.int64)
        self.rows = np.zeros(_MIN, dtype=np.int64)
        self.seqs = np.zeros(_MIN, dtype=np.int64)
        self.head = self.tail = 0
        self.front: list[tuple[int, int]] = []
        self.count = 0
        self._next_seq = 1

    def grow(self, size: int) -> None:
        extra = size - self.avail.shape[0]
        if extra > 0:
            self.avail = np.concatenate([self.avail, np.zeros(extra, bool)])
            self.seq = np.concatenate([self.seq, np.zeros(extra, np.int64)])

    def push(self, rows: np.ndarray, *, front: bool = False) -> None:
        """Make ``rows`` (not currently available) available."""
        n = len(rows)
        if n == 0:
            return
        seqs = np.arange(self._next_seq, self._next_seq + n, dtype=np.int64)
        self._next_seq += n
        self.avail[rows] = True
        self.seq[rows] = seqs
        self.count += n
        if front:
            self.front.extend(zip(rows.tolist(), seqs.tolist(), strict=True))
            return
        if self.tail + n > self.rows.shape[0]:
            self._compact(n)
        self.rows[self.tail : self.tail + n] = rows
        self.seqs[self.tail : self.tail + n] = seqs
        self.tail += n

    def push_row(self, row: int) -> None:
        """``push`` of one row (at the back)."""
        seq = self._next_seq
        self._next_seq += 1
        self.avail[row] = True
        self.seq[row] = seq
        self.count += 1
        if self.tail + 1 > self.rows.shape[0]:
            self._compact(1)
        self.rows[self.tail] = row
        self.seqs[self.tail] = seq
        self.tail += 1

    def remove(self, rows: np.ndarray) -> None:
        """Make available ``rows`` unavailable (leased, discarded or freed)."""
        if len(rows) == 1:  # one row: a scalar test, no fancy indexing
            row = int(rows[0])
            if self.avail[row]:
                self.avail[row] = False
                self.count -= 1
            return
        hit = rows[self.avail[rows]]
        self.avail[hit] = False
        self.count -= len(hit)

    def _valid(self, rows: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        valid: np.ndarray = self.avail[rows] & (self.seq[rows] == seqs)
        return valid

    def _compact(self, extra: int) -> None:
        rows, seqs = self.rows[self.head : self.tail], self.seqs[self.head : self.tail]
        keep = self._valid(rows, seqs)
        rows, seqs = rows[keep], seqs[keep]
        size = max(_MIN, 2 * (len(rows) + extra))
        if size > self.rows.shape[0] or size < self.rows.shape[0] // 4:
            self.rows = np.zeros(size, dtype=np.int64)
            self.seqs = np.zeros(size, dtype=np.int64)
        self.rows[: len(rows)] = rows
        self.seqs[: len(rows)] = seqs
        self.head, self.tail = 0, len(rows)

    def ordered(self, limit: int | None = None) -> np.ndarray:
        """Available rows, oldest first (at most ``limit`` if given)."""
        if not self.front:  # the usual case: no returned rows to put first
            return self._scan(limit)
        fr = np.asarray([r for r, _ in self.front], dtype=np.int64)
        fs = np.asarray([s for _, s in self.front], dtype=np.int64)
        keep = self._valid(fr, fs)
        self.front = [p for p, k in zip(self.front, keep.tolist(), strict=True) if k]
        front: np.ndarray = fr[keep]
        if limit is not None and len(front) >= limit:
            return front[:limit]
        want = None if limit is None else limit - len(front)
        return np.concatenate([front, self._scan(want)])

    def oldest(self) -> int | None:
        """``ordered(1)`` as an int (None if no row is available), without arrays."""
        if self.front:
            got = self.ordered(1)
            return int(got[0]) if len(got) else None
        while self.head < self.tail:  # an entry once invalid never becomes valid again
            row, seq = int(self.rows[self.head]), int(self.seqs[self.head])
            if self.avail[row] and self.seq[row] == seq:
                return row
            self.head += 1
        return None

    def _scan(self, want: int | None) -> np.ndarray:
        start, parts, found = self.head, [], 0
        chunk = self.tail - start if want is None else max(4 * want, 256)
        while start < self.tail and (want is None or found < want):
            stop = min(self.tail, start + chunk)
            rows, seqs = self.rows[start:stop], self.seqs[start:stop]
            valid = rows[self._valid(rows, seqs)]
            if start == self.head and len(valid) == 0:
                self.head = stop  # drop a fully consumed prefix
            parts.append(valid)
            found += len(valid)
            start, chunk = stop, chunk * 2
        out = parts[0] if len(parts) == 1 else \
            np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return out if want is None else out[:want]
