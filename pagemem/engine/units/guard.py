"""Evicted parameters cannot be computed with: a read the plan did not foresee fetches them.

[Note: evicted parameters]
While a unit is off the gpu its parameters' ``.data`` is a placeholder of the right shape, dtype
and device with one element of memory, and that element is NaN: a read that reaches it through
C++ (autograd reading a parameter it saved outside the engine's hooks) gives NaN, never a
plausible zero. Reads from Python never reach it: an evicted parameter's class is the engine's
``GuardedParameter`` (a subclass of ``nn.Parameter``, so ``isinstance`` holds; the object and its
identity never change), whose ``__torch_function__`` lets metadata through (shape, dtype, device,
``requires_grad``, ``grad``, hooks) and, before any op that reads values (``.data`` included),
fetches the unit on demand: counted in ``Engine.stats()["unforeseen_reads"]`` and, in a planned
iteration, as a miss. Outside the engine's calls (between forward and backward, between steps)
every parameter is guarded, resident or not, and an op that records autograd runs under the
engine's saved-tensor hooks, so a loss term over ``model.parameters()`` saves its parameters as
references the engine fetches again in backward rather than as page memory that may be evicted
by then. Inside the engine's forward and backward a resident parameter is a plain
``nn.Parameter`` and costs nothing; module scopes keep the ones a module may read resident
([Note: the residency rule], ``scopes.py``).

``state_dict()`` of the module (or any submodule, as ``save_pretrained`` calls it) returns host
copies of the current values (the fp32 master weights cast to the parameter's dtype) without
bringing anything to the gpu: the guard lets ``detach`` of an evicted parameter through while a
state dict is taken (``Guard.passthrough``), and a state-dict hook on every module holding parameters puts the values in.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import torch
from torch import nn

from pagemem.errors import InvalidRequest
from pagemem.process import current_pid, require_owner

_T = torch.Tensor
_GETTERS = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "ndim", "is_cuda",
            "is_meta", "is_sparse", "is_quantized", "is_cpu", "layout", "itemsize", "_backward_hooks",
            "_post_accumulate_grad_hooks", "is_nested", "_base", "output_nr", "_version")
_SETTERS = ("requires_grad", "grad", "_backward_hooks", "_post_accumulate_grad_hooks")
METADATA = frozenset([
    *(getattr(_T, n).__get__ for n in _GETTERS if hasattr(getattr(_T, n, None), "__get__")),
    *(getattr(_T, n).__set__ for n in _SETTERS if hasattr(getattr(_T, n, None), "__set__")),
    _T.size, _T.dim, _T.numel, _T.nelement, _T.element_size, _T.requires_grad_, _T.register_hook,
    _T.register_post_accumulate_grad_hook, _T.__hash__, _T.get_device, _T.is_floating_point,
    _T.is_complex, _T.__len__, _T.type, _T.__format__,
])
"""What a guarded parameter answers without its values."""


_DATA_GET = _T.data.__get__
_REPLACES = frozenset([_T.data.__set__, _T.set_])
"""Ops that give a parameter other memory (user code: the engine sets ``.data`` unguarded). The
new memory must keep the shape and dtype; its values are kept when residency next checks the
parameter (its storage moved: [Note: writes to parameters])."""


def intercept(owner: Any, func: Any, args: Sequence, kwargs: dict | None) -> Any:
    """The ``__torch_function__`` of the engine's tensor classes: metadata (or no owner) runs as
    on a plain tensor, anything else goes to ``owner.handle``, in the owner's process only (a
    forked child is refused before any fetch or lock: [Note: an engine belongs to its process])."""
    kwargs = kwargs or {}
    if owner is None or func in METADATA:
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    require_owner(f"{getattr(func, '__name__', func)} of a parameter or gradient of an engine's model",
                  owner.owner_pid)
    return owner.handle(func, args, kwargs)


class GuardedParameter(nn.Parameter):
    """The class of a parameter whose values are not at hand (see the Note). Each engine makes a
    subclass bound to its :class:`Guard`."""

    _guard: "Guard | None" = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence = (), kwargs: dict | None = None) -> Any:
        return intercept(cls._guard, func, args, kwargs)


class Guard:
    """Keeps each parameter's class in step with whether its values are at hand, and fetches
    those a read outside every scope needs (see the Note)."""

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]], fetch: Callable[[int], None],
                 lock: Any, saved_hooks: Callable[[], Any] | None = None,
                 data_taken: Callable[[int], None] | None = None, *,
                 resident: Callable[[int], bool]) -> None:
        """``fetch(i)`` makes parameter ``i``'s unit resident (under ``lock``); ``saved_hooks()``
        gives the context of the engine's saved-tensor hooks (for ops outside its calls);
        ``data_taken(i)``: parameter ``i``'s ``.data`` was handed out (code may write through it,
        which its version counter does not see: [Note: writes to parameters]); ``resident(i)``:
        parameter ``i``'s unit is bound (its ``Unit`` says: the guard keeps no copy of that)."""
        self.params = [p for _, p in params]
        self.names = [n for n, _ in params]
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.owner_pid = current_pid()
        """The engine's process: reads in any other are refused (``intercept``)."""
        self.cls = type("GuardedParameter", (GuardedParameter,), {"_guard": self})
        self._fetch = fetch
        self._data_taken = data_taken
        self.lock = lock
        self._saved_hooks = saved_hooks
        self._resident = resident
        self._calls = 0
        self._local = threading.local()
        self.reads = 0
        """Unforeseen reads that fetched a unit."""
        self.before_read: Callable[[int], None] | None = None
        """Called with each parameter an op reads outside the engine's calls, before it runs (the
        lock-free updater's ``settle``: [Note: reads between steps])."""
        self.closed: str | None = None
        """Why values can no longer be fetched (set by ``close``)."""
        self.refused: dict[int, str] = {}
        """Parameters ``close`` could not give their values, each with why (set by ``release``)."""
        for p in self.params:
            p.__class__ = self.cls

    # ---------------------------------------------------------------- residency
    def bound(self, i: int) -> None:
        """Parameter ``i``'s ``.data`` is its values now."""
        if self._calls:
            self.params[i].__class__ = nn.Parameter

    def evicted(self, i: int) -> None:
        """Parameter ``i``'s ``.data`` is a placeholder now."""
        self.params[i].__class__ = self.cls

    def enter(self) -> None:
        """The engine's forward or backward starts: resident parameters compute unguarded."""
        self._calls += 1
        if self._calls == 1:
            for i, p in enumerate(self.params):
                if self._resident(i):
                    p.__class__ = nn.Parameter

    def exit(self) -> None:
        self._calls -= 1
        if self._calls == 0:
            for p in self.params:
                p.__class__ = self.cls

    def release(self, values: Callable[[int], torch.Tensor | None] | None, why: str,
                refused: dict[int, str] | None = None) -> None:
        """The engine closes: give each parameter ``values(i)`` as its data and its plain class
        back; with ``values`` None, leave them guarded, refusing every read with ``why``. A
        parameter in ``refused`` (its values could not be read back) stays guarded, refusing
        every read with its own reason."""
        self.closed = why
        self.refused = dict(refused or {})
        if values is None:
            return
        for i, p in enumerate(self.params):
            if i in self.refused:
                continue
            with torch._C.DisableTorchFunctionSubclass():
                p.data = values(i)
            p.__class__ = nn.Parameter

    # ---------------------------------------------------------------- reads
    def passthrough(self) -> Any:
        """While active (on this thread), evicted parameters are read as they are, placeholders
        included: for the engine's own bookkeeping, and while a state dict is taken (its hook puts
        the values in)."""
        return _Quiet(self._local)

    def handle(self, func: Any, args: Sequence, kwargs: dict) -> Any:
        """An op on guarded parameters: fetch those evicted, then run it (see the Note)."""
        if not getattr(self._local, "quiet", 0):
            for i in self._guarded_in(args, kwargs):
                if self.before_read is not None and not self._calls:
                    self.before_read(i)
                if not self._resident(i):
                    self._fetch_for(i, func)
                if func == _DATA_GET and self._data_taken is not None:
                    self._data_taken(i)
        hooks = (self._saved_hooks() if self._saved_hooks is not None and not self._calls
                 and torch.is_grad_enabled() else nullcontext())
        if func in _REPLACES:
            self._check_replacement(args)
        with hooks, torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    def _check_replacement(self, args: Sequence) -> None:
        i = self.index.get(id(args[0]))
        new = args[1] if len(args) > 1 else None
        if i is None or not isinstance(new, torch.Tensor):
            return
        p = self.params[i]
        with torch._C.DisableTorchFunctionSubclass():
            same = tuple(new.shape) == tuple(p.shape) and new.dtype == p.dtype
        if not same:
            raise InvalidRequest(f"parameter {self.names[i]!r}: its memory was replaced by a tensor of shape "
                                 f"{tuple(new.shape)} and {new.dtype}; the engine keeps its shape and dtype "
                                 f"({tuple(p.shape)}, {p.dtype})")

    def _fetch_for(self, i: int, func: Any) -> None:
        require_owner(f"reading parameter {self.names[i]!r} of an engine's model", self.owner_pid)
        if self.closed is not None:
            raise InvalidRequest(f"parameter {self.names[i]!r}: {self.refused.get(i, self.closed)}")
        with self.lock:
            if not self._resident(i):
                self._fetch(i)
                self.reads += 1

    def _guarded_in(self, args: Sequence, kwargs: dict) -> list[int]:
        out = []
        index = self.index
        for a in (*args, *kwargs.values()):
            if isinstance(a, GuardedParameter):
                i = index.get(id(a))
                if i is not None:
                    out.append(i)
            elif isinstance(a, (list, tuple)):
                for x in a:
                    if isinstance(x, GuardedParameter):
                        i = index.get(id(x))
                        if i is not None:
                            out.append(i)
        return out


class Unguarded:
    """A guard that guards nothing (residency used without an engine, as in measurements)."""

    def bound(self, i: int) -> None:
        pass

    def evicted(self, i: int) -> None:
        pass

    def passthrough(self) -> Any:
        return nullcontext()


class _Quiet:
    def __init__(self, local: threading.local) -> None:
        self.local = local

    def __enter__(self) -> None:
        self.local.quiet = getattr(self.local, "quiet", 0) + 1

    def __exit__(self, *exc: object) -> None:
        self.local.quiet -= 1
