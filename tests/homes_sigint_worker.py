"""Ctrl-C landing inside the store's disk I/O of a backward with everything on nvme: run as a
process of its own (a hang fails the caller's timeout, not the test run).

``python homes_sigint_worker.py DIR IO_ENGINE`` prints ``ok`` and the outcome of each attempt."""

from __future__ import annotations

import signal
import sys

import torch

import pagemem
from pagemem.models.gpt import GPT, GPTConfig
from pagemem.tiers.io import aio as aio_module

CFG = GPTConfig(layers=2, hidden=64, heads=4, vocab=256, seq=32)


def loss(run, s):
    x = torch.randint(0, CFG.vocab, (2, 17), generator=torch.Generator().manual_seed(s))
    return run(x[:, :-1].contiguous(), x[:, 1:].contiguous())


def main() -> None:
    directory, io_engine = sys.argv[1], sys.argv[2]
    calls = {"n": 0, "at": -1}
    real = aio_module.AioEngine._io_submit

    def interrupted(self, blocks):  # the signal arrives after the request was counted, before the kernel took it
        calls["n"] += 1
        if calls["n"] == calls["at"]:
            signal.raise_signal(signal.SIGINT)
        return real(self, blocks)

    aio_module.AioEngine._io_submit = interrupted
    torch.manual_seed(0)
    model = GPT(CFG)
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes="64KiB", gpu_bytes=4 << 20, cpu_bytes=2 << 20,
                                nvme_bytes=64 << 20, nvme_path=directory, io_engine=io_engine)
    cfg = pagemem.EngineConfig(store=store, optimizer_tier="nvme", home_tier="nvme", executor="demand", adam_threads=1)
    outcomes = []
    with pagemem.Engine(model, cfg) as engine:
        for attempt in range(12):
            calls["n"], calls["at"] = 0, 1 + 7 * attempt  # a later disk request each time
            try:
                engine.backward(loss(engine, attempt))
                engine.step()
                outcomes.append("done")
            except KeyboardInterrupt:
                outcomes.append("interrupted")
                if engine.update_unfinished:
                    engine.step()
        engine.backward(loss(engine, 99))
        engine.step()
        assert all(torch.isfinite(v).all() for v in engine.state_dict().values())
    print("ok", " ".join(outcomes))


if __name__ == "__main__":
    main()
