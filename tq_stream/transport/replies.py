"""Running one decoded request and encoding its reply: shared by the socket servers."""

from __future__ import annotations

import logging
import time
from typing import Any

from tq_stream.errors import SerializationError, TQError, WaitTimeout, format_seconds
from tq_stream.handling import ANSWERED, WouldBlock
from tq_stream.serialization import decode, encode
from tq_stream.transport.answers import Outbox
from tq_stream.transport.dispatch import Dispatcher
from tq_stream.transport.remote_errors import error_to_value

logger = logging.getLogger(__name__)

BUSY = "ServerBusy"  # RemoteError.kind of the reply to a request refused for lack of room
DEFER = object()  # an inline call that would block: run it on a worker instead
INLINE_BYTES = 8 << 10  # tensors up to this size travel inside the header frame
Request = tuple[int, str, dict[str, Any], float]  # (id, method, args, timeout)


def parse_request(request: Any) -> Request:
    """``(id, method, args, timeout)`` of a decoded request, or SerializationError."""
    if not isinstance(request, dict):
        raise SerializationError(f"request must be a dict, got {type(request).__name__}")
    req_id, method = request.get("id"), request.get("method")
    args, timeout = request.get("args", {}), request.get("timeout", 0.0)
    if type(req_id) is not int or not isinstance(method, str) or not isinstance(args, dict):
        raise SerializationError(
            f"request needs an int 'id', a str 'method' and a dict 'args', got id={req_id!r}, "
            f"method={method!r}, args of type {type(args).__name__}"
        )
    if not isinstance(timeout, int | float) or isinstance(timeout, bool):
        raise SerializationError(f"request 'timeout' must be a number, got {timeout!r}")
    return req_id, method, args, float(timeout)


def read_request(frames: list[Any], where: str) -> tuple[Request | None, list[Any] | None]:
    """``(request, None)``, or ``(None, encoded error reply)`` for a bad request,
    or ``(None, None)`` when no one can receive an answer (no usable id)."""
    req_id = None
    try:
        request = decode(frames)
        if isinstance(request, dict) and type(request.get("id")) is int:
            req_id = request["id"]  # known early so a bad request still gets its answer
        return parse_request(request), None
    except Exception as exc:
        if req_id is None:
            logger.debug("dropped a request at %s: %s", where, exc)
            return None, None
        return None, error_reply(req_id, exc, where)


def run_request(dispatch: Dispatcher, request: Request, received: float, inline: bool,
                where: str, box: Outbox | None = None) -> Any:
    """The encoded reply to a parsed request; ``DEFER`` when an inline method would
    have to wait (the caller queues it for a worker). A request that waited longer
    than its caller's timeout before it could run is not run (the caller gave up).
    ``box`` is the outbox ``answers.serving`` gave this request: its ``request`` is
    the reply handle a method in its table's ``replies`` gets, and its ``send`` sends the
    replies the request gave to waiting ones, once the handler returned or raised,
    before this reply is encoded."""
    req_id, method, args, timeout = request
    reply = None if box is None else box.request
    try:
        try:
            if inline:
                result = dispatch.call_inline(method, args, reply)
            else:
                waited = time.monotonic() - received
                if timeout and waited > timeout:
                    raise WaitTimeout(
                        f"request {method!r} waited {format_seconds(waited)} for a worker at "
                        f"{where}, "
                        f"longer than its timeout {format_seconds(timeout)}; not run"
                    )
                result = dispatch(method, args, reply)
        finally:
            if box is not None and box.send is not None:
                box.send()
        if result is ANSWERED:
            return None  # another thread gave its reply already (answers.py)
        return ok_reply(req_id, result)
    except WouldBlock as exc:
        if inline:
            return DEFER
        return error_reply(req_id, exc, where)  # on a worker it is a handler bug
    except Exception as exc:
        return error_reply(req_id, exc, where)


def ok_reply(req_id: int, result: Any) -> list[Any]:
    return encode({"id": req_id, "ok": True, "result": result}, inline=INLINE_BYTES)


def given_replies(box: Outbox, where: str) -> list[tuple[Any, list[Any]]]:
    """``(reply_to, encoded reply)`` of each reply given to a waiting request while
    the request of ``box`` ran (``answers.py``); its server sends them."""
    out = []
    for waiting, result in box.replies:
        try:
            frames = ok_reply(waiting.req_id, result)
        except Exception as exc:  # noqa: BLE001 — the waiting caller gets the error
            frames = error_reply(waiting.req_id, exc, where)
        out.append((waiting.reply_to, frames))
    box.replies.clear()
    return out


def error_reply(req_id: int, exc: Exception, where: str) -> list[Any]:
    if not isinstance(exc, TQError):
        logger.warning("handler error at %s", where, exc_info=exc)
    return encode({"id": req_id, "ok": False, "error": error_to_value(exc, where)})


def busy_reply(req_id: int, message: str, where: str) -> list[Any]:
    """A RemoteError of kind ``BUSY``: the request was refused, never run."""
    error = {"kind": BUSY, "message": message, "where": where}
    return encode({"id": req_id, "ok": False, "error": error})
