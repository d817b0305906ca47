"""The op clock: the numbering the tracer records is the numbering a listener hears, for the same
model and step; every op starts and ends once, in order; the hooks go away even when the step raises."""

from __future__ import annotations

import pytest
import torch

from tracer_helpers import gpt_batch, gpt_step, hook_snapshot, make_gpt
from pagemem.tracer import OpClock, trace
from pagemem.tracer import clock as clock_mod
from pagemem.tracer import live


def listen(clock: OpClock) -> list[tuple[int, str, str, str, str]]:
    heard: list[tuple[int, str, str, str, str]] = []
    clock.subscribe(lambda op_id, edge, op: heard.append((op_id, edge, op.event, op.name, op.phase)))
    return heard


def starts(heard):
    return [(i, ev, name, phase) for i, edge, ev, name, phase in heard if edge == "start"]


def trace_ops(tr):
    return [(o.op_id, o.event, o.module, o.phase) for o in tr.ops]


CASES = {"tied": {}, "checkpointing": {"checkpoint_activations": True}, "untied": {"tie_embeddings": False},
         "checkpointing-untied": {"checkpoint_activations": True, "tie_embeddings": False}}


@pytest.mark.parametrize("case", list(CASES))
def test_clock_numbers_a_training_step_as_the_trace_does(case):
    model = make_gpt(**CASES[case])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tr = trace(model, gpt_step(model, optimizer=opt))  # a traced optimizer step: every op is hooked
    assert tr.meta["optimizer"].startswith("traced")
    with OpClock(model) as clock:
        heard = listen(clock)
        ops = []
        clock.subscribe(lambda op_id, edge, op: ops.append(op) if edge == "start" else None)
        gpt_step(model, optimizer=opt)()  # same model, same inputs
    assert starts(heard) == trace_ops(tr)
    assert clock.n_ops == len(tr.ops)
    if CASES[case].get("checkpoint_activations"):  # the recomputed forward is numbered as the trace has it
        assert any(ev.startswith("forward") and phase == "backward" for _, ev, _, phase in starts(heard))
    names = [n for n, _ in clock.params]
    uses = {op.name: op.params for op in ops if op.event == "forward_pre" and op.name in ("wte", "head")}
    if CASES[case].get("tie_embeddings", True):  # one parameter, owned by two modules
        assert "head.weight" not in names and uses["wte"] == uses["head"] == (names.index("wte.weight"),)
    else:
        assert uses["head"] == (names.index("head.weight"),)


def test_without_a_traced_step_the_trace_ends_with_a_modelled_step_the_engine_marks():
    model = make_gpt()
    tr = trace(model, gpt_step(model))
    assert tr.meta["optimizer"] == "modelled adam" and tr.ops[-1].event == "step"
    with OpClock(model) as clock:
        heard = listen(clock)
        gpt_step(model)()
        op = clock.mark("step", "optimizer", "step")
        clock.close()
    assert op.op_id == len(tr.ops) - 1
    assert starts(heard) == trace_ops(tr)


def test_every_op_starts_and_ends_once_in_order():
    model = make_gpt(checkpoint_activations=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with OpClock(model) as clock:
        heard = listen(clock)
        gpt_step(model, optimizer=opt)()
    edges = [(i, edge) for i, edge, *_ in heard]
    n = clock.n_ops
    assert edges == [(i, e) for i in range(n) for e in ("start", "end")]
    assert clock.current is None
    step = [h for h in heard if h[2] == "step"]
    assert [h[1] for h in step] == ["start", "end"]  # ended by the optimizer's post-hook


def test_reset_numbers_the_next_iteration_from_zero():
    model = make_gpt()
    step = gpt_step(model)
    with OpClock(model) as clock:
        first = listen(clock)
        step()
        clock.reset()
        n = len(starts(first))
        step()
    assert starts(first)[n:] == starts(first)[:n]


def test_the_tracer_records_through_an_op_clock_another_listener_can_share(monkeypatch):
    """An engine subscribing to the tracer's own clock hears exactly the trace's op ids."""
    model = make_gpt(checkpoint_activations=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    clocks: list[OpClock] = []
    heard: list = []

    class Spy(OpClock):
        def install(self):
            clocks.append(self)
            self.subscribe(lambda op_id, edge, op: heard.append((op_id, edge, op.event, op.name, op.phase)))
            return super().install()

    monkeypatch.setattr(live, "OpClock", Spy)
    tr = trace(model, gpt_step(model, optimizer=opt))
    assert len(clocks) == 1 and not clocks[0].installed
    assert starts(heard) == trace_ops(tr)


class Boom(Exception):
    pass


@pytest.mark.parametrize("where", ["forward", "backward", "step", "listener"])
def test_hooks_are_removed_when_the_step_raises(where):
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = hook_snapshot(model)
    idx, tgt = gpt_batch(model)

    def step():
        loss = model(idx, tgt)
        if where == "forward":
            raise Boom()
        if where == "backward":
            loss.register_hook(lambda g: (_ for _ in ()).throw(Boom()))
        loss.backward()
        if where == "step":
            opt.register_step_pre_hook(lambda *a: (_ for _ in ()).throw(Boom()))
            opt.step()

    clock = OpClock(model)
    if where == "listener":
        def fail(op_id, edge, op):
            if op_id == 5:
                raise Boom()

        unsubscribe = clock.subscribe(fail)
    with pytest.raises(Boom):
        with clock:
            assert hook_snapshot(model) != before
            step()
    opt._optimizer_step_pre_hooks.clear()
    assert not clock.installed and hook_snapshot(model) == before
    if where == "listener":
        unsubscribe()
    # graph hooks left on a live autograd graph fall silent
    n = clock.n_ops
    gpt_step(model)()
    assert clock.n_ops == n
    # and the clock works again
    with clock:
        clock.reset()
        gpt_step(model)()
    assert clock.n_ops > 0 and hook_snapshot(model) == before


def test_install_twice_and_bad_input():
    model = make_gpt()
    clock = OpClock(model).install()
    try:
        with pytest.raises(RuntimeError, match="already installed"):
            clock.install()
    finally:
        clock.remove()
    clock.remove()  # idempotent
    with pytest.raises(TypeError, match="nn.Module"):
        OpClock("not a model")
    assert clock_mod.EDGES == ("start", "end")


@pytest.mark.parametrize("case", ["checkpointing", "checkpointing-untied", "tied"])
def test_backward_on_another_thread_is_numbered_as_on_the_callers(case):
    """On CUDA, autograd runs backward on its device thread, whose node sequence numbers are its
    own (thread-local) and far from those of the forward's thread: a checkpointed block's forward,
    recomputed there, must hook only the nodes it made, so backward numbers its ops as when the
    caller's thread runs it (the first GPU run found planned iterations leaving their plan at
    a recomputed block's backward, at another op each time)."""
    import concurrent.futures

    model = make_gpt(**CASES[case])
    idx, tgt = gpt_batch(model)
    with OpClock(model) as clock:
        heard = listen(clock)
        model(idx, tgt).backward()  # backward on this thread: the reference numbering
        clock.reset()
        n = len(starts(heard))
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # one thread kept: its sequence numbers grow
            for _ in range(3):
                loss = model(idx, tgt)
                for _ in range(50):  # the worker's numbers drift from the caller's, as a device thread's do
                    pool.submit(lambda: torch.ones(1, requires_grad=True).mul(2)).result()
                pool.submit(loss.backward).result()
                clock.reset()
    runs = [starts(heard)[k * n:(k + 1) * n] for k in range(4)]
    assert len(starts(heard)) == 4 * n
    assert all(r == runs[0] for r in runs[1:])
