"""The tracer's own exception."""

from __future__ import annotations

from pagemem.errors import PageMemError


class TraceError(PageMemError):
    """Tracing could not produce a valid :class:`~pagemem.tracer.Trace`, or a trace file is invalid.

    Bad arguments raise :class:`pagemem.errors.ConfigError` instead.
    """
