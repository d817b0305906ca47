"""Gradients handed to host pages: every reader waits for the copy ([Note: gradient copies]).

On a machine without a GPU the copies are made to land only when waited for
(``grad_copies.DEFER_ON_HOST``): a reader that did not wait would read a stale sum, and the
training would differ from plain PyTorch.
"""

from __future__ import annotations

import threading

import pytest
import torch
from exactness import same_loop, train_both
from exactness_models import ParamAfterChild
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from test_engine_exactness import CASES, mse, seeded

import pagemem
from pagemem.engine.gradients import grad_copies
from pagemem.engine.gradients.grad_copies import GradCopies


@pytest.fixture
def deferred(monkeypatch):
    monkeypatch.setattr(grad_copies, "DEFER_ON_HOST", True)


def test_a_deferred_copy_lands_only_when_waited_for(deferred):
    copies = GradCopies()
    dst = torch.zeros(4)
    copies.put(0, dst, torch.ones(4), first=True)
    assert copies.in_flight() == 1 and torch.equal(dst, torch.zeros(4))
    copies.put(0, dst, torch.full((4,), 2.0), first=False)  # waits for the first before queueing
    assert torch.equal(dst, torch.ones(4)) and copies.in_flight() == 1
    copies.landed([1])  # another parameter's: this one stays in flight
    assert copies.in_flight() == 1
    copies.landed([0])
    assert torch.equal(dst, torch.full((4,), 3.0)) and copies.in_flight() == 0


class CopiesMachine(RuleBasedStateMachine):
    """Puts and waits in any order: a sum, once waited for, is what adding at once would give."""

    def __init__(self) -> None:
        super().__init__()
        grad_copies.DEFER_ON_HOST = True
        self.copies = GradCopies()
        self.dst = [torch.zeros(3) for _ in range(3)]
        self.model = [torch.zeros(3) for _ in range(3)]

    def teardown(self) -> None:
        grad_copies.DEFER_ON_HOST = False

    @rule(i=st.integers(0, 2), value=st.integers(-4, 4), first=st.booleans())
    def put(self, i, value, first):
        g = torch.full((3,), float(value))
        self.copies.put(i, self.dst[i], g, first)
        self.model[i] = g.clone() if first else self.model[i] + g
        g.fill_(99.0)  # autograd may reuse its gradient's memory once the hook returned

    @rule(which=st.lists(st.integers(0, 2), max_size=3))
    def landed(self, which):
        self.copies.landed(which)
        for i in which:
            assert torch.equal(self.dst[i], self.model[i])

    @invariant()
    def all_land(self):
        if self.copies.in_flight() == 0:
            assert all(torch.equal(d, m) for d, m in zip(self.dst, self.model))


TestCopiesMachine = CopiesMachine.TestCase
TestCopiesMachine.settings = settings(max_examples=60, stateful_step_count=20, deadline=None)


def test_readers_on_two_threads_see_a_sum_whole(deferred):
    """Two readers wait for the same sum at once (an update on a worker, the end of backward):
    neither returns before the add is done."""
    copies = GradCopies()
    dst = torch.zeros(1 << 16)
    copies.put(0, dst, torch.ones(1 << 16), first=True)
    copies.put(0, dst, torch.ones(1 << 16), first=False)
    seen = []

    def reader():
        copies.landed([0])
        seen.append(float(dst.min()))

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [2.0] * 4


@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
@pytest.mark.parametrize("kw", [{}, {"max_grad_norm": 0.05}, {"overlap_update": True}],
                         ids=["step", "clipped", "updates during backward"])
def test_training_with_copies_in_flight_is_exact(deferred, optimizer_tier, kw, tmp_path):
    make, loss = CASES["parameter read after a child"]
    if optimizer_tier == "nvme" and kw.get("overlap_update"):
        pytest.skip("states on nvme update in step()")
    stats = train_both(make, loss, 4, tmp_path, optimizer_tier=optimizer_tier, **kw)
    if kw.get("overlap_update"):
        assert stats["overlapped_updates"] > 0


def test_habits_reading_gradients_with_copies_in_flight_are_exact(deferred, tmp_path):
    """``loss.backward()``, a user hook reading ``p.grad`` during backward, a gradient set by
    hand, then ``engine.clip_grad_norm_`` (which reads that gradient's sum)."""
    seen: list[float] = []

    def loop(run, model, opt, s, loss):
        handles = [p.register_post_accumulate_grad_hook(lambda p: seen.append(float(p.grad.norm())))
                   for p in model.parameters()]
        try:
            loss(run, model, s).backward()
        finally:
            for h in handles:
                h.remove()
        w = next(model.parameters())
        w.grad = torch.full_like(w, 1e-3)  # read by the norm below, before any update
        if isinstance(run, pagemem.Engine):  # what Trainer and Lightning call
            run.clip_grad_norm_(0.05)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()

    same_loop(seeded(ParamAfterChild), mse, loop, 3, tmp_path)
    assert seen and all(x > 0 for x in seen)


def test_no_copy_is_left_in_flight_after_backward(deferred, tmp_path):
    make, loss = CASES["parameter read after a child"]
    from exactness import engine_config
    model = make()
    with pagemem.Engine(model, engine_config(make(), loss, tmp_path)) as engine:
        engine.backward(loss(engine, model, 0))
        assert engine.bank.copies.in_flight() == 0
