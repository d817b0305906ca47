"""What ``p.grad`` shows while the engine holds the gradients.

[Note: gradient handles]
The engine's gradients are fp32 sums in pages: autograd's own gradient is handed off as soon as
it is ready and ``p.grad`` set back to None. After each backward every parameter that has a
gradient sum gets a *handle* as ``p.grad``: a tensor of the parameter's shape, dtype and device
with no values (one element), whose ``__torch_function__`` does what plain PyTorch code does with
gradients, on the sums in pages:

- ``torch.linalg.vector_norm(g)`` / ``g.norm()`` / ``torch._foreach_norm`` (2-norms over the
  whole tensor): the norm of the gradient sum, computed over its pages as ``clip_grad_norm_``
  computes it, so ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` returns the
  true norm;
- ``g.mul_(c)`` / ``g.div_(c)`` / ``torch._foreach_mul_`` by a scalar, ``g.zero_()`` /
  ``torch._foreach_zero_``: done on the sums in place, over their pages;
- ``p.grad = None`` (``zero_grad()``, ``model.zero_grad()``): the gradient is discarded;
- ``p.grad = g`` (a tensor assigned by hand, after ``torch.autograd.grad`` say): ``g`` becomes
  the gradient sum, as torch's optimizer would step with it and backward would add to it;
- ``detach()`` and ``.data``: the handle itself; shape, dtype, device and the like: as they are;
- any other op (``clamp_`` of ``clip_grad_value_``, the inf-norm of ``clip_grad_norm_``, SAM's
  ``p.grad * scale``, ``p.grad.add_(p, alpha=wd)``, ``p.grad[mask] = 0``, ``clone()``, ...):
  runs on the gradient *materialised*, a tensor of the sum's values in the parameter's dtype on
  its device (counted in ``stats()["grad_materialised"]``); an op that writes a handle in place
  (a name ending in ``_``, ``__setitem__``, ``+=`` and the like, ``out=``, the first list of a
  ``torch._foreach_*_``) has what it wrote made the gradient sum. In fp32 this is plain
  PyTorch's arithmetic on the same values, bit for bit; a bf16/fp16 parameter's sum is fp32, so
  an op on it sees the sum rounded to the parameter's dtype, as plain PyTorch's ``p.grad`` is.
Before a backward adds to the sums the handles come down (the engine first reads which were
set to None), so autograd never accumulates into one. Which parameters have a gradient to show
is their gradient state's ([Note: gradient states] in ``grad_ledger.py``: ``GradLedger.pending``);
this module keeps only the handle tensors it put up.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from pagemem.engine.units.guard import intercept
from pagemem.errors import InvalidRequest
from pagemem.process import current_pid

_T = torch.Tensor
_NORMS = frozenset([torch.linalg.vector_norm, torch.norm, _T.norm])
_SELF = frozenset([_T.detach, _T.data.__get__])
_IN_PLACE_DUNDERS = frozenset(["__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                               "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                               "__irshift__", "__imatmul__"])


class GradHandle(torch.Tensor):
    """The class of ``p.grad`` while the engine holds ``p``'s gradient (see the Note); each
    engine makes a subclass bound to its :class:`GradHandles`."""

    _owner: "GradHandles | None" = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Sequence = (), kwargs: dict | None = None) -> Any:
        return intercept(cls._owner, func, args, kwargs)


class GradHandles:
    """Puts up and takes down the gradient handles of one engine's parameters."""

    def __init__(self, params: Sequence[tuple[str, nn.Parameter]], norm: Callable[[int], torch.Tensor],
                 scale: Callable[[int, float, bool], None], zero: Callable[[int], None],
                 read: Callable[[int], torch.Tensor], write: Callable[[int, torch.Tensor], None],
                 norms: Callable[[list[int]], list[torch.Tensor]] | None = None) -> None:
        """``norm(i)``: the 2-norm of parameter ``i``'s gradient sum (a 0-dim fp32 tensor);
        ``scale(i, c, divide)``: multiply it by ``c`` (divide: by ``c``) in place; ``zero(i)``:
        make it zero; ``read(i)``: a copy of it (fp32, flat); ``write(i, g)``: make ``g`` the sum;
        ``norms(indices)``: ``norm`` of each at once (``torch._foreach_norm``; default: one by one)."""
        self.params = [p for _, p in params]
        self._param_ids = {id(p) for p in self.params}
        self.names = [n for n, _ in params]
        self.owner_pid = current_pid()
        """The engine's process: ops on a handle in any other are refused (``guard.intercept``)."""
        self.cls = type("GradHandle", (GradHandle,), {"_owner": self})
        self._norm, self._scale, self._zero = norm, scale, zero
        self._read, self._write = read, write
        self._norms = norms if norms is not None else (lambda idx: [norm(i) for i in idx])
        self.materialised = 0
        """Gradients materialised for an op the handles do not do over pages (see the Note)."""
        self._up: dict[int, torch.Tensor] = {}
        """The handle put up as each parameter's ``p.grad`` since the last ``take_down`` (to tell
        a handle set to None or replaced; which gradients exist is the ledger's)."""
        self._of: dict[int, int] = {}
        """id(handle) -> parameter index."""

    def show(self, indices: Sequence[int]) -> None:
        """Put up a handle as ``p.grad`` of each parameter in ``indices`` (those with a gradient,
        ``GradLedger.pending``) that has none (again, where code set it to None since)."""
        zeros: dict[tuple, torch.Tensor] = {}
        with torch._C.DisableTorchFunctionSubclass():  # plain attribute reads and sets below
            for i in indices:
                p = self.params[i]
                if i in self._up:
                    if p.grad is None:  # set to None by a zero_grad that was refused: back up
                        p.grad = self._up[i]
                    continue
                key = (p.dtype, p.device)
                one = zeros.get(key)
                if one is None:
                    one = zeros[key] = torch.zeros((), dtype=p.dtype, device=p.device)
                h = one.expand(p.shape).as_subclass(self.cls)
                p.grad = h
                self._up[i] = h
                self._of[id(h)] = i

    def take_down(self) -> tuple[list[int], dict[int, torch.Tensor]]:
        """Remove every handle. Returns the parameters whose handle had been set to None (their
        gradients are discarded) and the gradients assigned by hand to any parameter's
        ``p.grad`` (as ``torch.autograd.grad`` users do: the engine takes them as the gradient),
        which are removed too."""
        dropped, assigned = [], {}
        with torch._C.DisableTorchFunctionSubclass():
            for i, p in enumerate(self.params):
                g = p.grad
                h = self._up.get(i)
                if g is None:
                    if h is not None:
                        dropped.append(i)
                    continue
                if g is not h:
                    if isinstance(g, GradHandle):
                        raise InvalidRequest(f"parameter {self.names[i]!r}: p.grad holds a gradient handle of "
                                             "another parameter or step")
                    assigned[i] = g.detach()
                p.grad = None
        self._up.clear()
        self._of.clear()
        return dropped, assigned

    # ---------------------------------------------------------------- what code does with them
    def handle(self, func: Any, args: Sequence, kwargs: dict) -> Any:
        name = getattr(func, "__name__", str(func))
        if func in _SELF:
            return args[0]
        if func in _NORMS and _two_norm(args, kwargs) and _all_handles(args[:1]):
            return self._norm(self._index(args[0]))
        if func is torch._foreach_norm and _two_norm(args, kwargs) and _all_handles(args[0]):
            return self._norms([self._index(g) for g in args[0]])
        if func in (_T.mul_, _T.div_) and not kwargs and _is_scalar(args[1]):
            self._scale(self._index(args[0]), float(args[1]), func is _T.div_)
            return args[0]
        if func is torch._foreach_mul_ and not kwargs and _all_handles(args[0]):
            c = args[1]
            cs = c if isinstance(c, (list, tuple)) else [c] * len(args[0])
            if all(_is_scalar(ci) for ci in cs):
                for g, ci in zip(args[0], cs):
                    self._scale(self._index(g), float(ci), False)
                return None
        if func is _T.zero_:
            self._zero(self._index(args[0]))
            return args[0]
        if func is torch._foreach_zero_ and _all_handles(args[0]):
            for g in args[0]:
                self._zero(self._index(g))
            return None
        return self._materialised(func, name, args, kwargs)

    def _materialised(self, func: Any, name: str, args: Sequence, kwargs: dict) -> Any:
        """``func`` run on the gradients' values in place of the handles; what it writes in
        place of a handle becomes that gradient sum (see the Note)."""
        values: dict[int, torch.Tensor] = {}

        def real(x: Any) -> Any:
            if not isinstance(x, GradHandle):
                if id(x) in self._param_ids:  # a parameter read beside its gradient (p.grad.add_(p)):
                    return x.detach()         # read through the guard, which fetches it if evicted
                return x
            i = self._index(x)
            if i not in values:
                p = self.params[i]
                with torch._C.DisableTorchFunctionSubclass():
                    values[i] = self._read(i).reshape(p.shape).to(device=p.device, dtype=p.dtype)
                self.materialised += 1
            return values[i]

        real_args, real_kwargs = tree_map(real, (tuple(args), kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*real_args, **real_kwargs)
        written = []
        if name.endswith("_") and not name.endswith("__") or name in _IN_PLACE_DUNDERS:
            first = args[0] if args else None
            written += first if isinstance(first, (list, tuple)) else [first]
        out_arg = kwargs.get("out")
        written += out_arg if isinstance(out_arg, (list, tuple)) else [out_arg]
        back = {id(values[self._index(h)]): h for h in written if isinstance(h, GradHandle)}
        for h in dict.fromkeys(h for h in written if isinstance(h, GradHandle)):
            i = self._index(h)
            self._write(i, values[i])
        return tree_map(lambda x: back.get(id(x), x), out)  # an op that returns what it wrote gives the handle

    def _index(self, g: Any) -> int:
        i = self._of.get(id(g))
        if i is None:
            raise InvalidRequest("p.grad: a gradient handle of an earlier step was kept and used; read p.grad again")
        return i



def _two_norm(args: Sequence, kwargs: dict) -> bool:
    """The 2-norm of the whole tensor: ord 2 (or the default), no dim, no keepdim, no dtype,
    however they are passed (what the pages compute; any other norm is materialised)."""
    given = dict(zip(("ord", "dim", "keepdim"), args[1:4]))
    given.update({("ord" if k == "p" else k): v for k, v in kwargs.items()})
    rest = {k: v for k, v in given.items() if k != "ord" and v is not None and v is not False}
    return given.get("ord", 2) in (2, 2.0, "fro", None) and not rest


def _all_handles(xs: Any) -> bool:
    return isinstance(xs, (list, tuple)) and all(isinstance(x, GradHandle) for x in xs)


def _is_scalar(c: Any) -> bool:
    """A Python number, or a one-element tensor that is not a handle (multiplying the pages by it
    is the same arithmetic as multiplying the gradient)."""
    if isinstance(c, torch.Tensor):
        return c.numel() == 1 and not isinstance(c, GradHandle) and c.dtype.is_floating_point
    return isinstance(c, (int, float)) and not isinstance(c, bool)
