"""kvt's exceptions, and how a kvt status code becomes one.

Mapping (status code -> exception):

============================  ===========================================================
``InvalidArgument``           :class:`ValueError` (the call's input is wrong; fix the call)
``OutOfRange``                :class:`OutOfRangeError` (a :class:`ValueError` and an
                              :class:`IndexError`: a page count or slot past the end)
``NotFound``                  :class:`KeyError` (an unknown room, peer or layer)
``DeadlineExceeded``          :class:`TransferTimeoutError` (a :class:`TransferError` and a
                              :class:`TimeoutError`)
everything else               :class:`TransferError` (``Unavailable``: retry the call;
                              ``Aborted``: retry higher up; ``FailedPrecondition``: fix the
                              state first, e.g. incompatible layouts)
============================  ===========================================================

Every exception raised from a kvt status carries ``code`` (the status code's name).
"""

from __future__ import annotations

__all__ = ["TransferError", "TransferTimeoutError", "OutOfRangeError", "from_status"]


class TransferError(RuntimeError):
    """A transfer, a connection or the engine failed.

    Attributes:
        room: the request's room ("" when the error concerns no request).
        reason: kvt's message (what went wrong, with the values).
        code: the kvt status code's name ("Aborted", "Unavailable", "FailedPrecondition", ...).
    """

    def __init__(self, message: str, room: str = "", reason: str = "", code: str = "Internal"):
        super().__init__(message)
        self.room = room
        self.reason = reason or message
        self.code = code


class TransferTimeoutError(TransferError, TimeoutError):
    """A deadline passed (kvt's DeadlineExceeded): a request's, or a connection's."""


class OutOfRangeError(ValueError, IndexError):
    """A count or index past its end (kvt's OutOfRange), e.g. a chunk past the decode side's
    page count. Catch it as ValueError or as IndexError."""


def from_status(code: str, message: str, room: str = "") -> BaseException:
    """The exception for a kvt status ``code`` (its name) with ``message``, for ``room``."""
    text = message
    if room and room not in message:
        text = f"room {room!r}: {message}"
    exc: BaseException
    if code == "InvalidArgument":
        exc = ValueError(text)
    elif code == "OutOfRange":
        exc = OutOfRangeError(text)
    elif code == "NotFound":
        exc = KeyError(text)
    elif code == "DeadlineExceeded":
        exc = TransferTimeoutError(text, room=room, reason=message, code=code)
    else:
        exc = TransferError(text, room=room, reason=message, code=code)
    exc.code = code  # type: ignore[attr-defined]
    return exc
