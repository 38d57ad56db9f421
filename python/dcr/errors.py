"""dcr's exceptions: one class per status code of the C++ core.

The extension raises every failure through ``_from_status`` (the one place a
``dcr::Status`` becomes an exception, called from ``Raise`` in
python/src/module.cc). The code tells the caller what to do next, as in
include/dcr/status.h:

- retry the call: :class:`UnavailableError` (alias :class:`StoreUnavailableError`),
  :class:`DeadlineExceededError`
- retry the attempt: :class:`AbortedError` (alias :class:`FencedAttemptError`),
  :class:`DataLossError` (alias :class:`CorruptFrameError`)
- stop and report: everything else. dcr reports a receiver or baseline that is
  not a delta's base as FAILED_PRECONDITION: :class:`FailedPreconditionError`,
  alias :class:`WrongBaseError`.
"""

from __future__ import annotations


class DcrError(Exception):
    """Base of every dcr error. ``code`` is the C++ status code's name
    (e.g. ``"DATA_LOSS"``), ``message`` its message."""

    code = "UNKNOWN"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidArgumentError(DcrError, ValueError):
    code = "INVALID_ARGUMENT"


class NotFoundError(DcrError, LookupError):
    code = "NOT_FOUND"


class AlreadyExistsError(DcrError):
    code = "ALREADY_EXISTS"


class PermissionDeniedError(DcrError, PermissionError):
    code = "PERMISSION_DENIED"


class OutOfRangeError(DcrError, IndexError):
    code = "OUT_OF_RANGE"


class FailedPreconditionError(DcrError):
    """The system is not in the state the call needs: most often a target or
    baseline that is not the delta's base."""

    code = "FAILED_PRECONDITION"


class AbortedError(DcrError):
    """A concurrent actor won: a fenced attempt, a lost race, every attempt failed."""

    code = "ABORTED"


class UnavailableError(DcrError):
    """Transient: a store or connection failed and its retries ran out."""

    code = "UNAVAILABLE"


class DeadlineExceededError(DcrError, TimeoutError):
    code = "DEADLINE_EXCEEDED"


class DataLossError(DcrError):
    """Stored or received bytes are corrupt or truncated (a bad frame checksum,
    a decode that misses its digest)."""

    code = "DATA_LOSS"


class UnimplementedError(DcrError, NotImplementedError):
    code = "UNIMPLEMENTED"


class InternalError(DcrError):
    code = "INTERNAL"


# Names callers look for.
WrongBaseError = FailedPreconditionError
CorruptFrameError = DataLossError
FencedAttemptError = AbortedError
StoreUnavailableError = UnavailableError

_BY_CODE: dict[str, type[DcrError]] = {
    cls.code: cls
    for cls in (InvalidArgumentError, NotFoundError, AlreadyExistsError, PermissionDeniedError, OutOfRangeError,
                FailedPreconditionError, AbortedError, UnavailableError, DeadlineExceededError, DataLossError,
                UnimplementedError, InternalError)
}


def _from_status(code: str, message: str) -> DcrError:
    """The exception for a non-OK C++ status (called by the extension)."""
    cls = _BY_CODE.get(code)
    return cls(message) if cls is not None else DcrError(message, code)


__all__ = ["DcrError", "WrongBaseError", "CorruptFrameError", "FencedAttemptError", "StoreUnavailableError",
           *(c.__name__ for c in _BY_CODE.values())]
