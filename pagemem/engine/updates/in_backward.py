"""What the updater does while a backward runs: gradients summed as autograd completes them, and
each parameter updated as soon as its gradient is final where that is exact ([Note: which
updates may overlap backward]), every write kept by the backward's journal ([Note: a failed
backward is undone], ``backward_undo.py``). A mixin of ``Updater`` (``update.py``): these methods
share its state."""

from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from pagemem.engine.gradients.grad_ledger import GradLedger, GradState
from pagemem.engine.updates.adam import AdamW, CpuAdam, join_all
from pagemem.engine.updates.backward_undo import HOLDS, BackwardUndo
from pagemem.errors import InvalidRequest

if TYPE_CHECKING:
    from pagemem.engine.config import EngineConfig
    from pagemem.engine.units.bank import ParamBank
    from pagemem.engine.updates.loss_scale import LossScaler
    from pagemem.store import PageStore

DONE: Future = Future()
"""The future of an update that ran in the hook."""
DONE.set_result(None)
_NONE, _ACCUMULATING, _SUMMED = GradState.NONE, GradState.ACCUMULATING, GradState.SUMMED
_UPDATING, _APPLIED = GradState.UPDATING, GradState.APPLIED


class UpdatesInBackward:
    bank: "ParamBank"
    store: "PageStore"
    config: "EngineConfig"
    data_parallel: bool
    ledger: GradLedger
    adam: CpuAdam
    scaler: "LossScaler"
    undo: BackwardUndo
    unfinished: Any
    hyper: Callable[[int], AdamW]
    overlap: bool
    _final: bool
    _fires_prev: dict[int, int]
    _fires_now: dict[int, int]
    _early: dict[int, Any]
    _early_hp: dict[int, AdamW]
    _early_stepped: set[int]

    if TYPE_CHECKING:  # Updater's
        def refuse_if_unfinished(self, what: str) -> None: ...

        def _update_one(self, i: int, hp: AdamW, grad: torch.Tensor | None = None) -> None: ...

    def begin_backward(self, final: bool) -> None:
        """A backward starts; ``final``: the last of this step's accumulation."""
        gone = self.ledger.count(_APPLIED)
        if gone:
            raise InvalidRequest(f"{gone} parameters were updated during the last backward "
                                 "(overlap_update) and their gradients are gone, so this backward cannot add to "
                                 "them as torch would: call optimizer.zero_grad() after optimizer.step(), or "
                                 "pass overlap_update=False")
        self.refuse_if_unfinished("backward")
        self._final = final
        self._fires_now = {}
        self._early_hp = {}
        self.undo.begin()

    def abort_backward(self) -> tuple[int, int]:
        """A backward failed part-way: it is undone ([Note: a failed backward is undone] in
        ``backward_undo.py``; the caller waited for its gradient copies). Returns how many
        parameters' updates during it were undone and how many sums were restored. If the
        restore raises, every gradient is discarded and the error propagates (the engine breaks)."""
        early, self._early = self._early, {}
        self._fires_now = {}
        self._early_stepped.clear()
        try:
            join_all(list(early.values()))  # none still writes pages once this returns
            return self.undo.restore(self.ledger)
        except BaseException:
            self.ledger.move_all((_ACCUMULATING, _SUMMED, _UPDATING, _APPLIED), _NONE)
            raise

    def end_backward(self) -> None:
        if self._final:
            self._fires_prev = self._fires_now
        self.undo.end()

    def grad_ready(self, i: int, grad: torch.Tensor) -> None:
        """Parameter ``i``'s gradient for this backward is complete (autograd's hook)."""
        fires = self._fires_now[i] = self._fires_now.get(i, 0) + 1
        before = self.ledger.state(i)
        if before is _UPDATING:
            raise RuntimeError(
                f"parameter {self.bank.params[i][0]!r} got a second gradient in this backward after it was "
                "updated (in the previous iteration it got one): the gradient structure changed between "
                "iterations; pass overlap_update=False to update only in step()")
        if self.undo.touch(i, before) and before in HOLDS:  # [Note: a failed backward is undone]
            self.undo.keep_sum(i)
        first = self.ledger.move(i, _ACCUMULATING) is _NONE
        states_on_gpu = self.bank.layers[self.bank.layer_of[i]].state_tier == "gpu"
        early = (self._final and fires == 1 and self._fires_prev.get(i) == 1 and self.overlap
                 and (not states_on_gpu or self.config.overlap_update is True))
        if early and first and states_on_gpu and grad.dtype == torch.float32:
            # [Note: updates in the hook] fp32 states on the gpu are stepped right here, on the
            # stream autograd runs on, from the gradient autograd made: no copy into the gradient
            # pages (which it would only be read back from) and no worker thread; that gradient
            # is freed when the hook returns, as the trace recorded. (A bf16/fp16 gradient goes
            # through the fp32 pages: casting it here would allocate what the trace never saw.)
            self._update_one(i, self._hyper_now(i), grad)
            self._early[i] = DONE
            self.ledger.move(i, _UPDATING)
            return
        self.bank.accumulate_grad(i, grad, first=first)
        if early:
            self._early[i] = self.adam.submit(self._update_one, i, self._hyper_now(i))
            self.ledger.move(i, _UPDATING)

    def keep_for_undo(self, i: int) -> None:
        """Parameter ``i``'s gradient sum is about to be written in this backward by something
        other than its own hand-off (another rank's gradients: [Note: sharded gradient sums]):
        kept first, for an undo ([Note: a failed backward is undone])."""
        before = self.ledger.state(i)
        if self.undo.touch(i, before) and before in HOLDS:
            self.undo.keep_sum(i)

    def unit_final(self, u: int) -> None:
        """Unit ``u`` has all its gradients of this backward (the hand-off): summed."""
        self.ledger.move_all(_ACCUMULATING, _SUMMED, unit=u)

    def summed(self) -> None:
        """The backward ended: every gradient it handed off is summed."""
        self.ledger.move_all(_ACCUMULATING, _SUMMED)

    def wait_for_updates(self, params: Iterable[int]) -> None:
        """Wait until the updates of ``params`` started during backward have landed (master,
        moments and compute copy written); their errors stay for ``step()`` to raise."""
        futures = [f for i in params if (f := self._early.get(i)) is not None]
        if futures:
            join_all(futures)

    def _hyper_now(self, i: int) -> AdamW:
        """The hyperparameters of parameter ``i``'s group for this backward's early updates, read
        once per group at the first of them."""
        g = self.bank.group_of(i)
        hp = self._early_hp.get(g)
        if hp is None:
            hp = self._early_hp[g] = self.hyper(g)
        return hp

    def _overlap_exact(self) -> bool:
        """[Note: which updates may overlap backward] A parameter's update needs only its own
        gradient, unless clipping (the global norm) or loss scaling (an overflow anywhere skips
        every update) is on. Its gradient is final once its hook fired as many times as in the
        previous iteration's last backward (once: the accumulation hook fires once per backward
        however often the parameter is used); after that no backward node reads its value. Then
        updating it at once gives the same bits as updating it in ``step()``, with the
        hyperparameters ``param_groups`` hold when backward starts updating (an lr scheduler steps
        after ``step()``; a change made between backward and ``step()`` is warned about, since
        those updates are done). Optimizer states on nvme are fetched and written back whole, in
        ``step()``. By default (``overlap_update=None``) a unit whose states are on the gpu is
        updated in ``step()`` all the same: its update is a fused kernel on the device backward
        runs on, so overlapping gains nothing, while the backward's journal ([Note: a failed
        backward is undone]) would copy its master weights and moments, 12 bytes per element,
        every iteration: on CUDA across PCIe to the host (the first GPU run: about 46 ms of a
        290 ms iteration where plain PyTorch took 240)."""
        cfg = self.config
        if cfg.overlap_update is None:  # see EngineConfig: where it costs no cores that backward uses
            wanted = self.store.cuda
        else:
            wanted = cfg.overlap_update
        return (wanted and cfg.max_grad_norm is None and self.scaler.scale is None
                and cfg.optimizer_tier != "nvme" and not cfg.lock_free and not self.data_parallel)

    def updated_during_backward(self) -> bool:
        """Updates ran during a backward that no ``step()`` has taken yet (one that failed
        part-way took them: ``refuse_if_unfinished`` says so)."""
        return self.unfinished is None and self.ledger.count(_UPDATING) > 0
