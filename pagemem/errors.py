"""The exceptions pagemem raises. Every one derives from :class:`PageMemError`."""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Callable

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class PageMemError(Exception):
    """Base class of every error pagemem raises on purpose."""


class ConfigError(PageMemError, ValueError):
    """A configuration value is out of range; the message names the field and the allowed range."""


class OutOfMemory(PageMemError, MemoryError):
    """A tier has too few free pages for a request. Raised before anything changes.

    Attributes name the tier, the pages and bytes asked for, and what was free; where a budget
    is refused as too small, ``least_bytes`` is the smallest that works (else None), or with
    ``least_is_bound`` the smallest this check can tell, which a later check may raise (the
    activations are known only once an iteration has run).
    """

    def __init__(self, tier: str, requested_pages: int, free_pages: int, page_bytes: int,
                 what: str = "", least_bytes: int | None = None, least_is_bound: bool = False) -> None:
        self.tier = tier
        self.least_bytes = least_bytes
        self.least_is_bound = least_is_bound
        self.requested_pages = requested_pages
        self.free_pages = free_pages
        self.page_bytes = page_bytes
        self.requested_bytes = requested_pages * page_bytes
        self.free_bytes = free_pages * page_bytes
        from pagemem.units import format_bytes

        detail = f" for {what}" if what else ""
        super().__init__(
            f"tier {tier!r} is out of memory{detail}: requested {requested_pages} pages "
            f"({format_bytes(self.requested_bytes)}), free {free_pages} pages "
            f"({format_bytes(self.free_bytes)}); nothing was changed"
            + ("" if least_bytes is None else
               f"; the smallest budget that works is at least {tier}_bytes={least_bytes} ({format_bytes(least_bytes)})"
               if least_is_bound else
               f"; the smallest budget that works is {tier}_bytes={least_bytes} ({format_bytes(least_bytes)})")
        )


class CorruptPage(PageMemError):
    """A page read back from disk does not match the checksum written with it."""

    def __init__(self, tier: str, slot: int, expected: int, actual: int, where: str = "") -> None:
        self.tier = tier
        self.slot = slot
        self.expected = expected
        self.actual = actual
        loc = f" ({where})" if where else ""
        super().__init__(
            f"corrupt page in tier {tier!r} slot {slot}{loc}: checksum {actual:#018x}, "
            f"expected {expected:#018x}; the data was not returned"
        )


class WeightsNotGivenBack(CorruptPage):
    """``close()`` gave every parameter it could read its trained weights, but the master
    weights of some could not be read back: a corrupt page (or bytes lost to a failed write).
    ``lost`` maps each such parameter's name to its error; the first CorruptPage's tier, slot
    and checksums are this error's own. Those parameters refuse every read rather than hold
    wrong values; recover them from a checkpoint. The engine released everything else."""

    def __init__(self, lost: "dict[str, BaseException]", kept: int) -> None:
        self.lost = dict(lost)
        self.kept = kept
        first = next((e for e in self.lost.values() if isinstance(e, CorruptPage)), None)
        self.tier = first.tier if first is not None else "nvme"
        self.slot = first.slot if first is not None else -1
        self.expected = first.expected if first is not None else 0
        self.actual = first.actual if first is not None else 0
        PageMemError.__init__(self, weights_lost_message(self.lost, kept))


def weights_lost_message(lost: "dict[str, BaseException]", kept: int) -> str:
    """What ``close()`` says of the parameters whose weights it could not give back."""
    each = "; ".join(f"{name!r}: {one_line(str(e))}" for name, e in lost.items())
    return (f"close: the trained weights of {len(lost)} parameter(s) could not be given back, their "
            f"master weights could not be read ({each}). The module's other {kept} parameter(s) hold "
            f"their trained weights; these {len(lost)} refuse every read and cannot be trained again. To "
            f"recover, load a checkpoint into a fresh model (pagemem.Engine.load(directory, new_model, "
            f"config), or new_model.load_state_dict of a state dict you saved); the engine is closed and "
            f"released everything")


class TierIOError(PageMemError, OSError):
    """A disk operation failed. The source copy of the data is still valid and readable."""

    def __init__(self, message: str, errno_: int | None = None) -> None:
        OSError.__init__(self, message)
        self.errno = errno_
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidRequest(PageMemError, ValueError):
    """A call was misused: unknown tier, wrong shape or dtype, a freed tensor, a closed store."""


class WrongProcess(InvalidRequest):
    """An engine or a store (or one of its tensors, handles, leases, parameters) was called in a
    process other than the one that made it: a child made by ``os.fork()``. Raised at once, with
    nothing of the owner's touched ([Note: an engine belongs to its process], ``process.py``).
    ``what`` names the call, ``owner_pid`` the owning process, ``pid`` this one."""

    def __init__(self, what: str, owner_pid: int, pid: int) -> None:
        self.what = what
        self.owner_pid = owner_pid
        self.pid = pid
        super().__init__(
            f"{what}: called in process {pid}, but this engine or store belongs to process {owner_pid}, "
            f"which made it; an engine and its store cannot be used in a process forked from their owner "
            f"(their threads, I/O context and locks exist only there). Make a new engine (or PageStore) "
            f"in process {pid}; nothing of process {owner_pid}'s was touched")

    def __reduce__(self) -> Any:
        return (type(self), (self.what, self.owner_pid, self.pid))


class TornPage(PageMemError):
    """A tensor's bytes were lost when an in-place disk write failed (there was no room for a
    copy-on-write). Reads of those bytes are refused until the tensor is written again."""


class StepFailed(PageMemError):
    """An update failed part-way, or a backward failed and undoing it failed too. The message
    says what landed and what to do: call ``step()`` again to finish the update exactly, or load
    a checkpoint."""


class RankFailed(PageMemError, RuntimeError):
    """Another rank of the process group died, raised, or did not reach a collective within the
    engine's ``collective_timeout_s``. ``ranks`` names the ranks found dead or behind (empty
    when they could not be told apart); the engine refuses every call after it (the group's
    collectives are out of step): exit and restart from the last checkpoint (``torchrun
    --max-restarts`` does)."""

    def __init__(self, message: str, ranks: "tuple[int, ...]" = ()) -> None:
        self.ranks = tuple(ranks)
        super().__init__(message)


class StepIOError(StepFailed, TierIOError):
    """``step()`` could not read the optimizer states from nvme, or the write-back of the last
    update's failed. Nothing of the update was lost: the message says what failed, and that the
    gradients are kept and ``step()`` again retries. A ``TierIOError`` (an ``OSError``) and a
    ``StepFailed``; the I/O error is chained as ``__cause__``."""

    def __init__(self, message: str, errno_: int | None = None) -> None:
        TierIOError.__init__(self, message, errno_)


class CorruptCheckpoint(PageMemError):
    """A checkpoint cannot be read as written: a file is missing, short, unparsable or fails its
    checksum, a value in its manifest is out of range, or ``latest`` names nothing. ``path`` is
    the file at fault. Nothing of the checkpoint was applied."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"corrupt checkpoint: {path}: {reason}")


class OperationFailed(PageMemError, RuntimeError):
    """Code that runs or completes an operation raised unexpectedly (a bug, a ``MemoryError``),
    typically on one of pagemem's threads. The operation failed with this error instead of never
    finishing; the message names the operation and the original exception is chained as
    ``__cause__``."""


class FirstError:
    """Cleanup whose every step must run: ``step(fn, *args)`` calls ``fn`` and keeps what it
    raises; leaving the ``with`` block raises the first error kept (a note counts the others).

    [Note: closing releases everything]
    ``close()`` gives back files, fds, threads and memory even when an earlier part of closing
    raises (a failed nvme write-back, a dead worker): each part is a step, later steps still
    run, and the caller gets the first error once everything is released.
    """

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def __call__(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> None:
        try:
            fn(*args, **kwargs)
        except BaseException as exc:  # every step runs; the first error is raised at the end
            self.errors.append(exc)

    def __enter__(self) -> "FirstError":
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None or not self.errors:
            return
        first = self.errors[0]
        if len(self.errors) > 1:
            first.add_note(f"closing raised {len(self.errors) - 1} more error(s): "
                           + "; ".join(repr(e) for e in self.errors[1:]))
        raise first


def one_line(text: str) -> str:
    """A message on one line (a command's error is one line on stderr)."""
    return " ".join(text.split())


def warn(message: str, category: type[Warning] = RuntimeWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside pagemem: the user's line that called
    into it, however many of pagemem's frames (an engine call's wrapper, its mixins) lie between."""
    level, frame = 2, sys._getframe(1)  # stacklevel 2: warn's caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        level, frame = level + 1, frame.f_back
    warnings.warn(message, category, stacklevel=level)
