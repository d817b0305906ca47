"""Model-based test of the recorder: windows, activation lifetimes, and per-op non-model bytes."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagemem.tracer.recorder import Recorder

N_PARAMS = 6
param_sets = st.lists(st.integers(0, N_PARAMS - 1), min_size=1, max_size=3, unique=True).map(tuple)
keys = st.integers(0, 5)


class RecorderMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        grads = [i % 3 != 0 for i in range(N_PARAMS)]  # params 0 and 3 are frozen
        self.rec = Recorder(N_PARAMS, grads)
        self.grads = grads
        self.ops = 0
        self.param_acc: list[list[int]] = [[] for _ in range(N_PARAMS)]
        self.grad_acc: list[list[int]] = [[] for _ in range(N_PARAMS)]
        self.fwd: list[tuple[int, tuple[int, ...]]] = []
        self.bwd: dict[int, tuple[int, ...]] = {}
        self.live: dict[int, list[int]] = {}  # key -> [activation index, refcount]
        self.acts: list[tuple[int, list[int]]] = []  # (nbytes, accesses)
        self.pending: list[int] = []
        self.peaks: list[int] = []
        self.live_bytes = 0

    def _touch(self, acc: list[int]) -> None:
        if not acc or acc[-1] != self.ops - 1:
            acc.append(self.ops - 1)

    def _touch_params(self, params: tuple[int, ...], grads: bool) -> None:
        for i in params:
            self._touch(self.param_acc[i])
            if grads and self.grads[i]:
                self._touch(self.grad_acc[i])

    def _bump(self, extra: int = 0) -> None:
        self.peaks[-1] = max(self.peaks[-1], self.live_bytes + extra)

    @rule(event=st.sampled_from(["forward_pre", "forward_post", "backward_pre", "grad_ready"]))
    def begin_op(self, event: str) -> None:
        assert self.rec.begin_op(event, "m", "forward") == self.ops
        for key in self.pending:
            entry = self.live.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del self.live[key]
                    self.live_bytes -= self.acts[entry[0]][0]
        self.pending.clear()
        self.ops += 1
        self.peaks.append(self.live_bytes)
        for _, params in self.fwd:
            self._touch_params(params, grads=False)
        for params in self.bwd.values():
            self._touch_params(params, grads=True)

    @precondition(lambda self: self.ops > 0)
    @rule(key=keys, params=param_sets)
    def forward_enter(self, key: int, params: tuple[int, ...]) -> None:
        self.rec.forward_enter(key, params, False)
        self.fwd.append((key, params))
        self._touch_params(params, grads=False)

    @rule(key=keys)
    def forward_exit(self, key: int) -> None:
        self.rec.forward_exit(key)
        for pos in range(len(self.fwd) - 1, -1, -1):
            if self.fwd[pos][0] == key:
                del self.fwd[pos:]
                break

    @precondition(lambda self: self.ops > 0)
    @rule(key=keys, params=param_sets)
    def backward_enter(self, key: int, params: tuple[int, ...]) -> None:
        self.rec.backward_enter(key, params)
        self.bwd[key] = params
        self._touch_params(params, grads=True)

    @rule(key=keys)
    def backward_exit(self, key: int) -> None:
        self.rec.backward_exit(key)
        self.bwd.pop(key, None)

    @precondition(lambda self: self.ops > 0)
    @rule(params=param_sets, grads=st.booleans())
    def touch(self, params: tuple[int, ...], grads: bool) -> None:
        self.rec.touch_params(params, grads)
        self._touch_params(params, grads)

    @precondition(lambda self: self.ops > 0)
    @rule(key=keys, nbytes=st.integers(1, 1000))
    def save(self, key: int, nbytes: int) -> None:
        # a save drains releases first (a storage freed and reused gets a new record)
        self.rec.save_activation(key, "m", "float32", (nbytes,), nbytes)
        for k in self.pending:
            entry = self.live.get(k)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del self.live[k]
                    self.live_bytes -= self.acts[entry[0]][0]
        self.pending.clear()
        if key in self.live:
            self.live[key][1] += 1
            self._touch(self.acts[self.live[key][0]][1])
        else:
            self.live[key] = [len(self.acts), 1]
            self.acts.append((nbytes, [self.ops - 1]))
            self.live_bytes += nbytes
        self._bump()

    @precondition(lambda self: self.ops > 0)
    @rule(key=keys)
    def use(self, key: int) -> None:
        self.rec.use_activation(key)
        if key in self.live:
            self._touch(self.acts[self.live[key][0]][1])

    @rule(key=keys)
    def release(self, key: int) -> None:
        held = self.live.get(key, [0, 0])[1] - self.pending.count(key)
        if held > 0:
            self.rec.release_activation(key)
            self.pending.append(key)

    @precondition(lambda self: self.ops > 0)
    @rule(nbytes=st.integers(0, 1000))
    def transient(self, nbytes: int) -> None:
        self.rec.transient(nbytes)
        self._bump(nbytes)

    @invariant()
    def same_accesses(self) -> None:
        assert self.rec.param_acc == self.param_acc
        assert [g for g, flag in zip(self.rec.grad_acc, self.grads) if flag] == \
               [g for g, flag in zip(self.grad_acc, self.grads) if flag]
        assert all(g is None for g, flag in zip(self.rec.grad_acc, self.grads) if not flag)
        assert [(a.nbytes, a.accesses) for a in self.rec.acts] == self.acts
        for acc in self.rec.param_acc + [a.accesses for a in self.rec.acts]:
            assert acc == sorted(set(acc))

    @invariant()
    def same_non_model_bytes(self) -> None:
        # closed ops carry their peak; the open one is checked when it closes (teardown)
        assert self.rec.op_non_model[:-1] == self.peaks[:-1]
        assert self.rec.live_bytes == self.live_bytes or self.pending

    def teardown(self) -> None:
        self.rec.end_op()
        assert self.rec.op_non_model == self.peaks


TestRecorder = RecorderMachine.TestCase
TestRecorder.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
