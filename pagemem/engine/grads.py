"""What ``p.grad`` shows while the engine holds the gradients.

[Note: gradient handles]
The engine's gradients are fp32 sums in pages: autograd's own gradient is handed off as soon as
it is ready and ``p.grad`` set back to None. After each backward every parameter that has a
gradient sum gets a *handle* as ``p.grad``: a tensor of the parameter's shape, dtype and device
with no values (one element), whose ``__torch_function__`` does what plain PyTorch code does with
gradients, on the sums in pages:

- ``torch.linalg.vector_norm(g)`` / ``g.norm()`` / ``torch._foreach_norm`` (2-norms over the
  whole tensor): the norm of the gradient sum, computed as ``clip_grad_norm_`` computes it, so
  ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` returns the true norm;
- ``g.mul_(c)`` / ``g.div_(c)`` / ``torch._foreach_mul_`` by a scalar: the gradient sum is
  multiplied (divided) in place (so clipping by habit clips, bit for bit as plain PyTorch);
- ``g.zero_()`` / ``torch._foreach_zero_``: the gradient becomes zero (AdamW still steps it);
- ``p.grad = None`` (``zero_grad()``, ``model.zero_grad()``): the gradient is discarded;
- ``p.grad = g`` (a tensor assigned by hand, after ``torch.autograd.grad`` say): ``g`` becomes
  the gradient sum, as torch's optimizer would step with it and backward would add to it;
- ``detach()`` and ``.data``: the handle itself; shape, dtype, device and the like: as they are;
- anything else raises ``InvalidRequest`` (use ``engine.get_global_grad_norm()``).
Before a backward adds to the sums the handles come down (the engine first reads which were
set to None), so autograd never accumulates into one.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from pagemem.engine.guard import intercept
from pagemem.errors import InvalidRequest

_T = torch.Tensor
_NORMS = frozenset([torch.linalg.vector_norm, torch.norm, _T.norm])
_SELF = frozenset([_T.detach, _T.data.__get__])


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
                 scale: Callable[[int, float, bool], None], zero: Callable[[int], None]) -> None:
        """``norm(i)``: the 2-norm of parameter ``i``'s gradient sum (a 0-dim fp32 tensor);
        ``scale(i, c, divide)``: multiply it by ``c`` (divide: by ``c``) in place; ``zero(i)``:
        make it zero."""
        self.params = [p for _, p in params]
        self.names = [n for n, _ in params]
        self.cls = type("GradHandle", (GradHandle,), {"_owner": self})
        self._norm, self._scale, self._zero = norm, scale, zero
        self._shown: dict[int, torch.Tensor] = {}
        self._of: dict[int, int] = {}
        """id(handle) -> parameter index."""

    def show(self, indices: Sequence[int]) -> None:
        """Put up a handle as ``p.grad`` of each parameter in ``indices`` that has none (again,
        where code set it to None since)."""
        zeros: dict[tuple, torch.Tensor] = {}
        with torch._C.DisableTorchFunctionSubclass():  # plain attribute reads and sets below
            for i in indices:
                p = self.params[i]
                if i in self._shown:
                    if p.grad is None:  # set to None by a zero_grad that was refused: back up
                        p.grad = self._shown[i]
                    continue
                key = (p.dtype, p.device)
                one = zeros.get(key)
                if one is None:
                    one = zeros[key] = torch.zeros((), dtype=p.dtype, device=p.device)
                h = one.expand(p.shape).as_subclass(self.cls)
                p.grad = h
                self._shown[i] = h
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
                h = self._shown.get(i)
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
        self._shown.clear()
        self._of.clear()
        return dropped, assigned

    # ---------------------------------------------------------------- what code does with them
    def handle(self, func: Any, args: Sequence, kwargs: dict) -> Any:
        name = getattr(func, "__name__", str(func))
        if func in _SELF:
            return args[0]
        if func in _NORMS:
            self._check_two_norm(args, kwargs, name)
            return self._norm(self._index(args[0]))
        if func is torch._foreach_norm:
            self._check_two_norm(args, kwargs, name)
            return [self._norm(self._index(g)) for g in args[0]]
        if func is _T.mul_:
            self._scale(self._index(args[0]), _scalar(args[1], name), False)
            return args[0]
        if func is _T.div_:
            self._scale(self._index(args[0]), _scalar(args[1], name), True)
            return args[0]
        if func is torch._foreach_mul_:
            c = args[1]
            cs = c if isinstance(c, (list, tuple)) else [c] * len(args[0])
            for g, ci in zip(args[0], cs):
                self._scale(self._index(g), _scalar(ci, name), False)
            return None
        if func is _T.zero_:
            self._zero(self._index(args[0]))
            return args[0]
        if func is torch._foreach_zero_:
            for g in args[0]:
                self._zero(self._index(g))
            return None
        raise InvalidRequest(f"p.grad: the engine keeps gradients as fp32 sums in pages; {name} on them is not "
                             "supported (norms, clipping by a scalar, zero_() and zero_grad() are: see "
                             "engine.get_global_grad_norm() and engine.clip_grad_norm_())")

    def _index(self, g: Any) -> int:
        i = self._of.get(id(g))
        if i is None:
            raise InvalidRequest("p.grad: a gradient handle of an earlier step was kept and used; read p.grad again")
        return i

    @staticmethod
    def _check_two_norm(args: Sequence, kwargs: dict, name: str) -> None:
        """Only the 2-norm of the whole tensor: ord 2 (or the default), no dim, no keepdim, no
        dtype, however they are passed."""
        given = dict(zip(("ord", "dim", "keepdim"), args[1:4]))
        given.update({("ord" if k == "p" else k): v for k, v in kwargs.items()})
        ord_ = given.get("ord", 2)
        bad = {k: v for k, v in given.items() if k != "ord" and v is not None and v is not False}
        if ord_ not in (2, 2.0, "fro", None) or bad:
            raise InvalidRequest(f"p.grad: {name} of the engine's gradients is supported as the 2-norm of the "
                                 f"whole tensor only, got ord={ord_!r}{' ' + str(bad) if bad else ''}")


def _scalar(c: Any, name: str) -> float:
    if isinstance(c, torch.Tensor) and c.numel() == 1:
        return float(c)
    if isinstance(c, (int, float)) and not isinstance(c, bool):
        return float(c)
    raise InvalidRequest(f"p.grad: {name} of the engine's gradients takes a scalar, got {type(c).__name__}")
