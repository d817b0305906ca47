"""A disk that fails under ``step()``: the optimizer states' read from nvme, or the write-back of
the last update's. The error is a ``TierIOError`` (and a ``StepFailed``) whose message says what
failed, that the gradients are kept and that ``step()`` again retries; retried once the disk
works, the run ends with the weights plain PyTorch gives. The lock-free updater cannot retry:
its message says so."""

from __future__ import annotations

import threading

import pytest

import pagemem
from pagemem.tiers.io import FaultyEngine

from exactness import assert_same, engine_config, reference
from test_engine_exactness import CASES

STEPS = 5


def faulty(engine) -> FaultyEngine:
    nvme = engine.store.tier("nvme")
    nvme.engine = FaultyEngine(nvme.engine)
    return nvme.engine


@pytest.mark.parametrize("what,executor", [("write-back", "plan"), ("write-back", "demand"), ("read", "demand")])
@pytest.mark.parametrize("kind", ["eio", "enospc"])
def test_a_step_the_disk_failed_says_so_and_step_again_retries_exactly(tmp_path, what, executor, kind):
    make, loss = CASES["parameter read after a child"]
    expected = reference(make, loss, STEPS)
    model = make()
    engine = pagemem.Engine(model, engine_config(make(), loss, tmp_path, "nvme", executor))
    with engine:
        faults = faulty(engine)
        for s in range(2):
            engine.backward(loss(engine, model, s))
            engine.step()
        engine.backward(loss(engine, model, 2))
        if what == "write-back":  # this update's write-back fails behind it; the next step() finds it
            faults.fail_next("write", kind)  # the unit's states: one run, one request
            engine.step()
            engine.backward(loss(engine, model, 3))
        else:  # demand paging stages nothing during backward: the update reads the states itself
            faults.fail_next("read", "eio" if kind == "enospc" else kind)
        with pytest.raises(pagemem.TierIOError) as raised:
            engine.step()
        err = raised.value
        assert faults.injected == 1
        assert isinstance(err, OSError) and isinstance(err, pagemem.StepFailed)
        assert isinstance(err.__cause__, pagemem.TierIOError) and err.errno == err.__cause__.errno
        text = str(err)  # the message itself, not a note
        assert ("writing the last update's optimizer states back to nvme failed" if what == "write-back"
                else "reading the optimizer states from nvme for the update failed") in text
        assert "the gradients are kept" in text and "call step() again to retry" in text
        assert ("ENOSPC" if what == "write-back" and kind == "enospc" else "EIO") in text
        assert engine.update_unfinished
        with pytest.raises(pagemem.StepFailed, match=r"call step\(\) again"):  # nothing else until then
            engine.zero_grad()
        assert engine.step()  # the disk works again: the same update, retried
        for s in range(engine.global_step, STEPS):
            engine.backward(loss(engine, model, s))
            engine.step()
        assert_same(expected, engine.state_dict())


def test_a_step_the_disk_keeps_failing_raises_again_and_changes_nothing(tmp_path):
    make, loss = CASES["parameter read after a child"]
    expected = reference(make, loss, 2)
    model = make()
    with pagemem.Engine(model, engine_config(make(), loss, tmp_path, "nvme", "demand")) as engine:
        faults = faulty(engine)
        engine.backward(loss(engine, model, 0))
        engine.step()
        engine.backward(loss(engine, model, 1))
        for _ in range(3):
            faults.fail_next("read", "eio", count=1)
            with pytest.raises(pagemem.StepIOError, match="call step"):
                engine.step()
        assert engine.step()
        assert_same(expected, engine.state_dict())


def test_the_lock_free_updater_says_what_failed_and_that_it_cannot_retry(tmp_path):
    make, loss = CASES["parameter read after a child"]
    model = make()
    engine = pagemem.Engine(model, engine_config(make(), loss, tmp_path, "nvme", lock_free=True))
    faults = faulty(engine)
    faults.fail_next("write", "eio", count=10_000)
    with pytest.raises(pagemem.StepFailed) as raised:
        for s in range(6):  # within an iteration or so, never a hang
            engine.backward(loss(engine, model, s))
            engine.step()
    text = str(raised.value)
    assert "optimizer states back to nvme failed" in text and "EIO" in text
    assert "cannot retry" in text and "load the last checkpoint" in text
    assert isinstance(raised.value.__cause__, pagemem.TierIOError)
    with pytest.raises(pagemem.StepFailed, match="cannot retry"):
        engine.step()
    with pytest.raises(pagemem.StepFailed):
        engine.close()
    assert not [t for t in threading.enumerate() if t.name == "pagemem-lockfree" and t.is_alive()]
