"""Calls from a second thread while the training loop runs ([Note: calls from several threads]).

The loop trains; another thread calls ``state_dict()``, ``model.state_dict()``, ``save()``,
``save_weights()``, ``step()`` or ``close()`` over and over, or at a random moment. Every weight set it gets back
must be the weights of plain PyTorch after some whole number of steps (never a mix of before
and after one), and every refusal must say what runs. Nothing hangs: each thread is joined with
a timeout.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import nn

import pagemem
from pagemem.errors import InvalidRequest

D = 48
STEPS = 6


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(D, D), nn.Tanh())], nn.Linear(D, 1))


def batch(i: int):
    g = torch.Generator().manual_seed(500 + i)
    return torch.randn(8, D, generator=g), torch.randn(8, 1, generator=g)


def config(tmp_path, tier: str, overlap: bool) -> pagemem.EngineConfig:
    if tier == "nvme":
        (tmp_path / "nvme").mkdir(exist_ok=True)
    store = pagemem.StoreConfig(page_bytes="16KiB", gpu_bytes="192KiB", cpu_bytes="4MiB", gpu_backend="host",
                                nvme_bytes="4MiB" if tier == "nvme" else 0,
                                nvme_path=str(tmp_path / "nvme") if tier == "nvme" else None)
    return pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(lr=1e-2, weight_decay=0.1),
                                optimizer_tier=tier, overlap_update=overlap)


def snapshots() -> tuple[list[dict[str, torch.Tensor]], list[dict[int, torch.Tensor]]]:
    """Plain PyTorch's weights, and each parameter's ``exp_avg``, after 0, 1, ..., STEPS steps."""
    model = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    out, moments = [{k: v.clone() for k, v in model.state_dict().items()}], [{}]
    for i in range(STEPS):
        x, y = batch(i)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        out.append({k: v.clone() for k, v in model.state_dict().items()})
        moments.append({n: s["exp_avg"].clone() for n, s in opt.state_dict()["state"].items()})
    return out, moments


SNAPSHOTS, MOMENTS = snapshots()


def which_step(state: dict[str, torch.Tensor]) -> int:
    """The number of steps whose weights ``state`` holds; fails on a mix."""
    for k, snap in enumerate(SNAPSHOTS):
        if all(torch.equal(state[n].float(), snap[n]) for n in snap):
            return k
    per = {n: [k for k, s in enumerate(SNAPSHOTS) if torch.equal(state[n].float(), s[n])] for n in SNAPSHOTS[0]}
    raise AssertionError(f"a torn mix of steps: {per}")


def train(engine: pagemem.Engine, by_habit: bool, stop: threading.Event | None = None) -> int:
    """The loop; returns the steps it took (it stops at a closed engine)."""
    for i in range(STEPS):
        x, y = batch(i)
        try:
            loss = nn.functional.mse_loss(engine(x), y)
            loss.backward() if by_habit else engine.backward(loss)
            engine.step()
        except InvalidRequest as e:
            assert "closed" in str(e), e
            return i
    return STEPS


def refused_for_a_reason(e: BaseException) -> bool:
    """A refusal a second thread may get: it says what runs (a backward by habit on the loop's
    thread), or that the engine is closed, or that gradients await a step (save)."""
    text = str(e)
    return isinstance(e, InvalidRequest) and ("on thread" in text or "closed" in text or "step()" in text)


def run_beside(engine: pagemem.Engine, by_habit: bool, call) -> tuple[list, list[BaseException]]:
    """The loop on this thread; ``call()`` over and over on another until the loop ends."""
    results: list = []
    errors: list[BaseException] = []
    done = threading.Event()

    def other() -> None:
        while not done.is_set():
            try:
                results.append(call())
            except BaseException as e:  # noqa: BLE001 - every outcome is checked below
                errors.append(e)

    t = threading.Thread(target=other, daemon=True)
    t.start()
    try:
        train(engine, by_habit)
    finally:
        done.set()
        t.join(timeout=120)
    assert not t.is_alive(), "the second thread hangs"
    return results, errors


@pytest.mark.parametrize("by_habit", [False, True], ids=["engine.backward", "loss.backward"])
@pytest.mark.parametrize("tier,overlap", [("cpu", False), ("cpu", True), ("nvme", False)])
@pytest.mark.parametrize("reader", ["engine.state_dict", "model.state_dict"])
def test_state_dicts_from_another_thread_are_never_a_mix(reader, tier, overlap, by_habit, tmp_path):
    model = make()
    with pagemem.Engine(model, config(tmp_path, tier, overlap)) as engine:
        read = engine.state_dict if reader == "engine.state_dict" else (lambda: model.state_dict())
        results, errors = run_beside(engine, by_habit, read)
        assert results, "the reader never got in"
        seen = sorted({which_step(r) for r in results})
        assert all(refused_for_a_reason(e) for e in errors), errors[:3]
        assert which_step(engine.state_dict()) == STEPS
    assert seen[0] >= 0 and seen[-1] <= STEPS


@pytest.mark.parametrize("by_habit", [False, True], ids=["engine.backward", "loss.backward"])
def test_saves_from_another_thread_hold_whole_steps(by_habit, tmp_path):
    model = make()
    saved: list[str] = []
    with pagemem.Engine(model, config(tmp_path, "nvme", False)) as engine:
        def save() -> str:
            path = engine.save(str(tmp_path / "ckpt"))
            saved.append(path)
            return path
        results, errors = run_beside(engine, by_habit, save)
        assert all(refused_for_a_reason(e) for e in errors), errors[:3]
    assert saved
    for path in saved[:: max(1, len(saved) // 4)]:
        again = pagemem.Engine.load(path, make())
        try:
            k = which_step(again.state_dict())
            assert again.global_step == k
        finally:
            again.close()


@pytest.mark.parametrize("by_habit", [False, True], ids=["engine.backward", "loss.backward"])
def test_weights_saved_from_another_thread_hold_whole_steps(by_habit, tmp_path):
    """``save_weights`` is one call: its files hold the weights after a whole number of steps,
    with updates during backward too."""
    from safetensors.torch import load_file

    model = make()
    with pagemem.Engine(model, config(tmp_path, "cpu", True)) as engine:
        count = iter(range(1 << 30))
        results, errors = run_beside(engine, by_habit,
                                     lambda: engine.save_weights(tmp_path / f"w{next(count)}")[0])
        assert all(refused_for_a_reason(e) for e in errors), errors[:3]
    assert results, "the saver never got in"
    seen = sorted({which_step(load_file(path)) for path in results})
    assert seen[0] >= 0 and seen[-1] <= STEPS


def test_two_threads_stepping_update_once_each_backward(tmp_path):
    """Two threads call ``step()`` after each backward: exactly one of them updates, the other
    finds nothing to update; never "page pinned"."""
    model = make()
    with pagemem.Engine(model, config(tmp_path, "nvme", False)) as engine:
        for i in range(STEPS):
            x, y = batch(i)
            engine.backward(nn.functional.mse_loss(engine(x), y))
            got: list = []
            threads = [threading.Thread(target=lambda: got.append(engine.step())) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            assert sorted(got) == [False, True]
        assert which_step(engine.state_dict()) == STEPS


@pytest.mark.parametrize("by_habit", [False, True], ids=["engine.backward", "loss.backward"])
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(delay=st.floats(0.0, 0.3), seed=st.integers(0, 2 ** 16))
def test_close_from_another_thread_at_a_random_moment(by_habit, delay, seed, tmp_path_factory):
    """``close()`` lands between two calls of the loop (or is refused while a backward by habit
    runs, and then lands later): the module keeps whole weights, and the loop stops cleanly."""
    tmp_path = tmp_path_factory.mktemp("close")
    model = make()
    engine = pagemem.Engine(model, config(tmp_path, random.Random(seed).choice(["cpu", "nvme"]), False))
    outcome: list = []

    def closer() -> None:
        threading.Event().wait(delay)
        while True:
            try:
                engine.close()
                outcome.append("closed")
                return
            except InvalidRequest as e:
                assert "on thread" in str(e), e  # a backward by habit runs: try again
            except BaseException as e:  # noqa: BLE001
                outcome.append(e)
                return

    t = threading.Thread(target=closer, daemon=True)
    t.start()
    steps = train(engine, by_habit)
    t.join(timeout=120)
    assert not t.is_alive()
    engine.close()
    assert outcome == ["closed"]
    k = which_step({n: p.detach() for n, p in model.state_dict().items()})
    assert k == engine.global_step and k <= steps


def test_optimizer_state_dicts_from_another_thread_hold_whole_steps(tmp_path):
    """``engine.optimizer.state_dict()`` beside the loop: its moments are those of one step."""
    model = make()
    with pagemem.Engine(model, config(tmp_path, "nvme", False)) as engine:
        results, errors = run_beside(engine, False, lambda: engine.optimizer.state_dict()["state"])
        assert not errors, errors[:3]
    steps = set()
    for state in results:
        if not state:
            continue
        k = [k for k in range(1, STEPS + 1) if all(torch.equal(state[n]["exp_avg"], MOMENTS[k][n]) for n in MOMENTS[k])]
        assert len(k) == 1, "a torn mix of steps' moments"
        steps.add(k[0])
    assert steps


# ---------------------------------------------------------------- found by a hostile user (issue 30)

def test_a_state_dict_hook_that_raises_leaves_no_lock_held(tmp_path):
    """A user's state-dict hook raising part-way must not leave the engine's call lock held: a
    call from another thread then still gets in."""
    model = make()
    with pagemem.Engine(model, config(tmp_path, "cpu", False)) as engine:
        train(engine, False)

        def boom(*_a, **_k):
            raise RuntimeError("a user's hook")

        handle = model[2].register_state_dict_pre_hook(boom)
        with pytest.raises(RuntimeError, match="a user's hook"):
            model.state_dict()
        handle.remove()
        got: list = []
        t = threading.Thread(target=lambda: got.append(engine.stats()), daemon=True)
        t.start()
        t.join(timeout=30)
        assert got, "the other thread waits for a lock nobody holds"
        assert which_step({k: v for k, v in model.state_dict().items()}) == STEPS


@pytest.mark.parametrize("by_habit", [False, True], ids=["engine.backward", "loss.backward"])
def test_state_dicts_after_a_failed_backward_with_overlap_are_undone_first(by_habit, tmp_path):
    """The usual "save on Ctrl-C": after a backward that raised part-way with updates during it,
    ``model.state_dict()`` and ``optimizer.state_dict()`` show the weights and moments before it."""
    from exactness_models import OnBackward

    model = make()
    model[0].register_forward_hook(lambda m, i, o: OnBackward.apply(o))  # its backward runs last
    with pagemem.Engine(model, config(tmp_path, "cpu", True)) as engine:
        for i in range(3):
            x, y = batch(i)
            loss = nn.functional.mse_loss(engine(x), y)
            OnBackward.pending[:] = [KeyboardInterrupt()] if i == 2 else []
            try:
                loss.backward() if by_habit else engine.backward(loss)
            except KeyboardInterrupt:
                moments = engine.optimizer.state_dict()["state"]
                weights = {k: v.clone() for k, v in model.state_dict().items()}
                break
            engine.step()
        assert which_step(weights) == 2
        assert all(torch.equal(moments[n]["exp_avg"], MOMENTS[2][n]) for n in MOMENTS[2])
