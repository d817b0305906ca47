"""``pagemem demo``: a model-sized set of tensors stored across the three tiers, swept through the
``gpu`` tier layer by layer as a training iteration would, every byte verified.

The tensors are the parameters of the project's GPT (bf16, one page group per layer). The store
gets a ``gpu`` budget of a quarter of the model, ``cpu`` half, and ``nvme`` all of it, so the
model only fits by using every tier.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch
import xxhash

from pagemem.config import StoreConfig
from pagemem.errors import OutOfMemory
from pagemem.models import GPT, gpt_config
from pagemem.store import MoveHandle, PagedTensor, PageStore
from pagemem.units import format_bytes, parse_size

DTYPE = torch.bfloat16


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="gpt2-medium",
                        help="GPT preset whose parameters are stored (default gpt2-medium, 355M params)")
    parser.add_argument("--page_bytes", default="4MiB", help="page size (default 4MiB)")
    parser.add_argument("--nvme_path", default=None,
                        help="directory for the NVMe page file (default: a new temporary directory)")
    parser.add_argument("--io_engine", default="auto", choices=["auto", "aio", "threads"])
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")


@dataclass
class Layer:
    name: str
    tensors: list[PagedTensor]
    digests: list[int]

    def pages(self) -> int:
        return len({p for t in self.tensors for p in t.pages})


def _digest(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.contiguous().view(torch.uint8).numpy())


def _layer_shapes(model_name: str) -> list[tuple[str, list[tuple[str, torch.Size]]]]:
    """The GPT's parameters grouped by layer (embeddings, each block, final norm), no memory used."""
    with torch.device("meta"):
        model = GPT(gpt_config(model_name))
    groups: dict[str, list[tuple[str, torch.Size]]] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        layer = ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        groups.setdefault(layer, []).append((name, p.shape))
    return list(groups.items())


class Sweeper:
    """Moves layers through the gpu tier in order, evicting the oldest to cpu (or nvme)."""

    def __init__(self, store: PageStore, layers: list[Layer]) -> None:
        self.store = store
        self.layers = layers
        self.on_gpu: list[tuple[Layer, MoveHandle]] = []
        self.evictions: list[MoveHandle] = []

    def _free(self, tier: str) -> int:
        return self.store.tier(tier).free_pages

    def _make_room_on_gpu(self, pages: int) -> None:
        while self._free("gpu") < pages:
            if self.evictions:
                self.evictions.pop(0).wait()
                continue
            if not self.on_gpu:
                raise OutOfMemory("gpu", pages, self._free("gpu"), self.store.page_bytes, "the demo's largest layer")
            layer, handle = self.on_gpu.pop(0)
            handle.wait()
            dest = "cpu" if self._free("cpu") >= layer.pages() else "nvme"
            self.evictions.append(self.store.move(layer.tensors, dest))

    def fetch(self, layer: Layer) -> MoveHandle:
        self._make_room_on_gpu(layer.pages())
        handle = self.store.move(layer.tensors, "gpu")
        self.on_gpu.append((layer, handle))
        return handle

    def sweep(self, order: list[Layer]) -> int:
        """Fetch each layer to gpu one ahead of its use; verify it there. Returns mismatches."""
        bad = 0
        pending = self.fetch(order[0])
        for i, layer in enumerate(order):
            pending.wait()
            if i + 1 < len(order):
                pending = self.fetch(order[i + 1])  # prefetch overlaps this layer's "compute"
            bad += sum(_digest(t.to_torch()) != d for t, d in zip(layer.tensors, layer.digests))
        return bad

    def drain(self) -> None:
        for handle in self.evictions:
            handle.wait()
        self.evictions.clear()


def run(args: argparse.Namespace) -> int:
    groups = _layer_shapes(args.model)
    model_bytes = sum(s.numel() for _, shapes in groups for _, s in shapes) * DTYPE.itemsize
    page = parse_size(args.page_bytes, "page_bytes")
    largest = max(sum(s.numel() for _, s in shapes) for _, shapes in groups) * DTYPE.itemsize
    gpu = max(model_bytes // 4, 3 * (largest + 2 * page))
    made_dir = args.nvme_path is None
    nvme_dir = tempfile.mkdtemp(prefix="pagemem-demo-") if made_dir else args.nvme_path
    cfg = StoreConfig(page_bytes=page, gpu_bytes=gpu, cpu_bytes=model_bytes // 2,
                      nvme_bytes=model_bytes + 2 * len(groups) * page + 2 * page,
                      nvme_path=nvme_dir, io_engine=args.io_engine)
    results: dict = {"model": args.model, "model_bytes": model_bytes, "page_bytes": page, "phases": []}
    try:
        with PageStore(cfg) as store:
            print(store.describe())
            print(f"\nmodel {args.model}: {len(groups)} layers, "
                  f"{sum(len(s) for _, s in groups)} tensors, {format_bytes(model_bytes)} in {DTYPE}\n")
            phases = []

            def phase(name: str, fn):
                before = store.stats().moves
                t0 = time.perf_counter()
                out = fn()
                store.synchronize()
                seconds = time.perf_counter() - t0
                after = store.stats().moves
                moved = sum(m.bytes for m in after.values()) - sum(m.bytes for m in before.values())
                phases.append((name, seconds, moved))
                return out

            layers: list[Layer] = []

            def place_and_write() -> None:
                g = torch.Generator().manual_seed(0)
                for name, shapes in groups:
                    specs = [(s, DTYPE) for _, s in shapes]
                    after = layers[-1].tensors[-1] if layers else None  # chain: no page tails wasted
                    try:
                        tensors = store.allocate_group(specs, tier="cpu", after=after)
                    except OutOfMemory:
                        tensors = store.allocate_group(specs, tier="nvme", after=after)
                    digests = []
                    for t, (_, shape) in zip(tensors, shapes):
                        data = torch.randn(shape, generator=g).to(DTYPE)
                        t.copy_(data)
                        digests.append(_digest(data))
                    layers.append(Layer(name, tensors, digests))

            phase("write: cpu, overflow to nvme", place_and_write)
            phase("offload all to nvme", lambda: store.move([t for l in layers for t in l.tensors], "nvme").wait())
            sweeper = Sweeper(store, layers)
            bad = phase("forward sweep through gpu", lambda: sweeper.sweep(layers))
            bad += phase("backward sweep through gpu", lambda: sweeper.sweep(layers[::-1]))
            phase("settle evictions", sweeper.drain)

            def verify_all() -> int:
                return sum(_digest(t.to_torch()) != d for l in layers for t, d in zip(l.tensors, l.digests))

            final_bad = phase("verify every tensor in place", verify_all)
            stats = store.stats()

            print(f"{'phase':<32} {'seconds':>8} {'moved':>11} {'GB/s':>7}")
            for name, seconds, moved in phases:
                rate = moved / seconds / 1e9 if moved else 0.0
                print(f"{name:<32} {seconds:>8.2f} {format_bytes(moved):>11} {rate:>7.2f}")
                results["phases"].append({"phase": name, "seconds": seconds, "bytes_moved": moved})
            print()
            print(stats.table())
            where = {tier: sum(1 for l in layers for t in l.tensors if t.tier == tier) for tier in ("gpu", "cpu", "nvme")}
            n_tensors = sum(len(l.tensors) for l in layers)
            verdict = "all bytes verified" if bad + final_bad == 0 else f"{bad + final_bad} MISMATCHES"
            print(f"\n{n_tensors} tensors now on gpu/cpu/nvme: {where['gpu']}/{where['cpu']}/{where['nvme']}; "
                  f"{verdict} ({bad} during sweeps, {final_bad} at the end)")
            results.update(
                mismatches=bad + final_bad, tensors=n_tensors, where=where,
                moves={k: {"pages": m.pages, "bytes": m.bytes, "seconds": m.seconds} for k, m in stats.moves.items()},
                utilization={k: v.utilization for k, v in stats.tiers.items()},
                backends={k: v.backend for k, v in stats.tiers.items()},
            )
    finally:
        if made_dir:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if results["mismatches"] == 0 else 1
