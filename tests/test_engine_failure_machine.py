"""A state machine over the engine with failures injected anywhere: after every step the
weights equal plain PyTorch driven by the operations that succeeded, and nothing (file, fd,
thread) outlives ``close()``.

Operations: a training iteration; one whose forward, backward (error or Ctrl-C), update
(before or after a parameter's master changed) or nvme write-back fails; finishing a failed
update; ``zero_grad`` after a backward; save; load (a new engine and model from the newest
checkpoint).
"""

from __future__ import annotations

import copy
import os
import threading

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import pagemem
from pagemem.engine.updates import update as update_module
from pagemem.tiers.io.faults import FaultyEngine
from exactness import HP, engine_config
from exactness_models import OnBackward
from test_engine_transaction import X, loss_of, make


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class Raising:
    """Wraps a callable to raise ``exc`` on its ``after``-th call, once."""

    def __init__(self, real, exc: BaseException, after: int) -> None:
        self.real, self.exc, self.left = real, exc, after

    def __call__(self, *args, **kwargs):
        self.left -= 1
        if self.left == -1:
            raise self.exc
        return self.real(*args, **kwargs)


class EngineUnderFailures(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="pagemem-machine-")
        self.fds = open_fds()
        self.threads = {t.ident for t in threading.enumerate()}
        self.ref = make()
        self.opt = torch.optim.AdamW(self.ref.parameters(), fused=True, **HP)
        self.saved = None
        self.unfinished = False
        self.batch = 0
        self.cfg = engine_config(make(), loss_of, self.dir, "nvme", adam_threads=2)
        self.model = make()
        self.engine = pagemem.Engine(self.model, self.cfg)
        self.nvme = self.engine.store.tier("nvme")
        self.nvme.engine = FaultyEngine(self.nvme.engine)

    def _next(self) -> int:
        self.batch = (self.batch + 1) % len(X)
        return self.batch

    def _reference_step(self, s: int) -> None:
        loss_of(self.ref, self.ref, s).backward()
        self.opt.step()
        self.opt.zero_grad()

    # ---------------------------------------------------------------- rules

    @precondition(lambda self: not self.unfinished)
    @rule()
    def train(self):
        s = self._next()
        self.engine.backward(loss_of(self.engine, self.model, s))
        self.engine.step()
        self._reference_step(s)

    @precondition(lambda self: not self.unfinished)
    @rule()
    def forward_fails(self):
        self.model.fail_forward = True
        try:
            loss_of(self.engine, self.model, self._next())
            raise AssertionError("the forward did not fail")
        except RuntimeError:
            pass
        finally:
            self.model.fail_forward = False

    @precondition(lambda self: not self.unfinished)
    @rule(ctrl_c=st.booleans())
    def backward_fails(self, ctrl_c):
        OnBackward.pending.append(KeyboardInterrupt() if ctrl_c else RuntimeError("backward failed"))
        try:
            self.engine.backward(loss_of(self.engine, self.model, self._next()))
            raise AssertionError("the backward did not fail")
        except (RuntimeError, KeyboardInterrupt):
            pass
        finally:
            OnBackward.pending.clear()

    @precondition(lambda self: not self.unfinished)
    @rule(after=st.integers(0, 5), where=st.sampled_from(["update", "refresh"]))
    def update_fails(self, after, where):
        s = self._next()
        self.engine.backward(loss_of(self.engine, self.model, s))
        if where == "update":
            real = update_module.fused_steps
            update_module.fused_steps = Raising(real, RuntimeError("adam failed"), after)
        else:
            real = self.engine.bank.refresh_compute
            self.engine.bank.refresh_compute = Raising(real, RuntimeError("refresh failed"), after)
        try:
            self.engine.step()
            self._reference_step(s)  # the fault never fired (fewer calls than ``after``)
        except pagemem.StepFailed:
            self.unfinished = True
            self.pending = s
        finally:
            if where == "update":
                update_module.fused_steps = real
            else:
                del self.engine.bank.refresh_compute

    @precondition(lambda self: self.unfinished)
    @rule()
    def finish_update(self):
        try:
            self.engine.backward(loss_of(self.engine, self.model, 0))
            raise AssertionError("backward was accepted during an unfinished step")
        except pagemem.StepFailed:
            pass
        assert self.engine.step()
        self.unfinished = False
        self._reference_step(self.pending)

    @precondition(lambda self: not self.unfinished)
    @rule(kind=st.sampled_from(["eio", "enospc"]))
    def write_back_fails(self, kind):
        """The step's write-back of optimizer states to nvme fails: the states stay valid in
        memory, the error surfaces at the next flush, and training goes on exactly."""
        s = self._next()
        self.engine.backward(loss_of(self.engine, self.model, s))
        self.nvme.engine.fail_next("write", kind)
        self.engine.step()
        self._reference_step(s)
        try:
            self.engine.updater.flush()
        except pagemem.TierIOError:
            pass

    @precondition(lambda self: not self.unfinished)
    @rule()
    def zero_grad_discards(self):
        self.engine.backward(loss_of(self.engine, self.model, self._next()))
        self.engine.zero_grad()

    @precondition(lambda self: not self.unfinished)
    @rule()
    def save(self):
        try:
            self.engine.save(os.path.join(self.dir, "ckpt"))
        except pagemem.TierIOError:  # a failed write-back from before surfaces here: save again
            self.engine.save(os.path.join(self.dir, "ckpt"))
        self.saved = (copy.deepcopy(self.ref.state_dict()), copy.deepcopy(self.opt.state_dict()))

    @precondition(lambda self: self.saved is not None)
    @rule()
    def load(self):
        self.engine.close()
        self.unfinished = False
        self.model = make()
        self.engine = pagemem.Engine.load(os.path.join(self.dir, "ckpt"), self.model, self.cfg)
        self.nvme = self.engine.store.tier("nvme")
        self.nvme.engine = FaultyEngine(self.nvme.engine)
        self.ref.load_state_dict(self.saved[0])
        self.opt.load_state_dict(copy.deepcopy(self.saved[1]))  # torch's load aliases the moments it is given

    # ---------------------------------------------------------------- checks

    @invariant()
    def same_weights_as_plain_pytorch(self):
        if self.unfinished:
            return
        got = self.engine.state_dict()
        want = self.ref.state_dict()
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        assert not bad, bad

    def teardown(self) -> None:
        OnBackward.pending.clear()
        self.engine.close()
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
        assert open_fds() <= self.fds, open_fds() - self.fds
        alive = {t.ident for t in threading.enumerate() if t.is_alive()} - self.threads
        assert not alive, [t.name for t in threading.enumerate() if t.ident in alive]


TestEngineUnderFailures = EngineUnderFailures.TestCase
TestEngineUnderFailures.settings = settings(max_examples=12, stateful_step_count=12, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])
