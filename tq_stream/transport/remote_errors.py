"""Exceptions as values: how a handler's error crosses a transport and is raised again."""

from __future__ import annotations

import sys
import traceback
from typing import Any

from tq_stream import errors
from tq_stream.errors import RemoteError, SerializationError, TQError

# Only classes of the tq_stream tree are re-raised by name; anything else becomes
# RemoteError, so a received name can never select an arbitrary class.
_CLASSES: dict[str, type[TQError]] = {
    cls.__name__: cls
    for cls in vars(errors).values()
    if isinstance(cls, type) and issubclass(cls, TQError)
}
# A server that could not reach another server did run the caller's request: for the
# caller that is a plain timeout, not "never sent".
_CLASSES[errors.Unreachable.__name__] = errors.WaitTimeout
_CLASSES[errors.ConnectionLost.__name__] = errors.WaitTimeout


def error_to_value(exc: BaseException, where: str) -> dict[str, str]:
    """The msgpack-able form of ``exc`` raised at ``where``.

    tq_stream errors are expected outcomes and travel without a traceback; any
    other exception is a bug on the far side, so its traceback goes along.
    """
    # A RemoteError passed on keeps its original kind; its message names where it began.
    kind = exc.kind if isinstance(exc, RemoteError) else type(exc).__name__
    message = str(exc)
    trace = "" if isinstance(exc, TQError) else "".join(traceback.format_exception(exc))
    return {"kind": kind, "message": message, "where": where, "traceback": trace}


def error_from_value(value: Any, where: str) -> TQError:
    """Rebuild the exception an error reply describes.

    Args:
        value: the ``error_to_value`` dict received.
        where: the address to name if the reply does not say.

    Returns:
        An instance of the same tq_stream error class with the same message,
        or a RemoteError carrying the remote class name.

    Raises:
        SerializationError: ``value`` is not a well-formed error value.
    """
    if not isinstance(value, dict) or not all(
        isinstance(value.get(k), str) for k in ("kind", "message", "where")
    ):
        raise SerializationError(f"malformed error reply from {where}: {value!r}")
    kind, message = value["kind"], value["message"]
    where = value["where"] or where
    cls = _CLASSES.get(kind)
    if cls is None or cls is RemoteError:
        exc: TQError = RemoteError(kind, message, where)
    else:
        exc = cls(message)
        _add_note(exc, f"raised at {where}")
    trace = value.get("traceback")
    if isinstance(trace, str) and trace:
        _add_note(exc, f"remote traceback:\n{trace}")
    return exc


def _add_note(exc: BaseException, note: str) -> None:
    # add_note is Python >= 3.11; on 3.10 the notes are kept but not printed.
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:
        vars(exc)["__notes__"] = [*vars(exc).get("__notes__", []), note]
