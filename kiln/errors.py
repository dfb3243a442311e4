"""User-facing errors.

A ``KilnError`` is a mistake the user can fix (a flag, a file, a request). The CLI prints its
message as one line and exits non-zero; the server turns it into a 4xx. Messages name the
thing, the value, the rule and the fix.
"""

from __future__ import annotations


class KilnError(Exception):
    """A user-facing error with a message that says what to do."""


class SourceError(KilnError):
    """A model source could not be read (missing file, corrupt file, unsupported model)."""


class EngineFormatError(KilnError):
    """An engine directory is missing files, has a bad checksum or an unknown format version."""


class RequestError(ValueError):
    """One request asked for something the engine cannot do; ``param`` names the
    SamplingParams field or ``add_request`` argument it concerns (None: the server knows
    better, e.g. which field held a grammar). A ValueError, so callers that catch those keep
    working; the server maps ``param`` to its own field name and answers 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
