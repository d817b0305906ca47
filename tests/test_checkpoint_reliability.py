"""Checkpoints under damage and failure: a save verifies every page and works across
filesystems, a failed save leaves the previous checkpoint ``latest`` and nothing else behind,
every damaged checkpoint is refused with a PageMemError naming the file, a refused load leaves
the model as it was, and the config in force decides the precision policy."""

from __future__ import annotations

import functools

import dataclasses
import errno
import json
import os
import shutil

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.engine.checkpoints import manifest as mf
from pagemem.models.gpt import GPT, GPTConfig
from pagemem.store import export
from conftest import engine_gpu_budget

PAGE = 64 * 1024


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=16))


def _batch(step: int):
    x = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(1000 + step))
    return x[:, :-1], x[:, 1:]


@functools.lru_cache(maxsize=1)
def _gpu_budget() -> int:
    """The activations plus a third of the parameters (``nbytes // 2`` is below the activations,
    which the engine now refuses)."""
    idx, targets = _batch(0)
    return engine_gpu_budget(tiny_gpt(), lambda m: torch.nn.functional.cross_entropy(
        m(idx).reshape(-1, 128), targets.reshape(-1)).backward(), PAGE, 1 / 3)


def config(nvme: str, dtype: torch.dtype = torch.float32, **kw) -> pagemem.EngineConfig:
    nbytes = sum(p.numel() * 4 for p in tiny_gpt().parameters())
    os.makedirs(nvme, exist_ok=True)
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=PAGE, gpu_bytes=_gpu_budget(),
                                cpu_bytes=16 * nbytes + 64 * PAGE, nvme_bytes=16 * nbytes + 64 * PAGE, nvme_path=nvme)
    return pagemem.EngineConfig(store=store, optimizer_tier="nvme", adam_threads=1, compute_dtype=dtype,
                                optimizer=pagemem.AdamW(lr=3e-3, weight_decay=0.1), **kw)


def train(engine, until: int) -> None:
    while engine.global_step < until:
        idx, targets = _batch(engine.global_step)
        engine.backward(torch.nn.functional.cross_entropy(engine(idx).reshape(-1, 128), targets.reshape(-1)))
        engine.step()


def everything(engine) -> dict[str, torch.Tensor]:
    """Weights, moments and counters of ``engine``, to compare bit for bit."""
    out = {f"w.{k}": v for k, v in engine.state_dict().items()}
    for i, s in engine.optimizer.state_dict()["state"].items():
        out.update({f"s.{i}.{k}": torch.as_tensor(v) for k, v in s.items()})
    out["global_step"] = torch.tensor(engine.global_step)
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def leftovers(root) -> list[str]:
    return [n for n in os.listdir(root) if ".tmp-" in n]


def latest(root) -> str:
    with open(os.path.join(root, "latest")) as f:
        return f.read()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint at step 2 (root ``ckpt``), its config, and everything it holds."""
    base = tmp_path_factory.mktemp("saved")
    cfg = config(str(base / "nvme"))
    with pagemem.Engine(tiny_gpt(), cfg) as engine:
        train(engine, 2)
        engine.save(str(base / "ckpt"))
    with pagemem.Engine.load(str(base / "ckpt"), tiny_gpt(7), cfg) as engine:
        expected = everything(engine)
    return Saved((base / "ckpt", cfg, expected))


class Saved(tuple):
    def __repr__(self) -> str:  # hypothesis prints its arguments
        return f"Saved({self[0]})"


def copy_of(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved[0], root)
    return root, os.path.join(root, latest(root))


# ------------------------------------------------------------------------- save

def test_a_save_across_filesystems_falls_back_to_a_buffered_copy(tmp_path, monkeypatch):
    """Page files on /dev/shm (tmpfs), the checkpoint on /tmp: copy_file_range refuses with
    EXDEV, the pages are copied through a buffer, and the checkpoint resumes bit for bit."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp directory")
    nvme = f"/dev/shm/pagemem-test-{os.getpid()}"
    copied = []
    real = export.copy_range
    monkeypatch.setattr(export, "copy_range", lambda *a: (copied.append(a), real(*a))[1])
    try:
        cfg = config(nvme)
        with pagemem.Engine(tiny_gpt(), cfg) as engine:
            train(engine, 2)
            path = engine.save(str(tmp_path / "ckpt"))
            expected = everything(engine)
            assert copied, "no page was copied from the nvme page file"
            src = os.open(copied[0][0], os.O_RDONLY)
            dst = os.open(tmp_path / "probe", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                with pytest.raises(OSError) as refused:  # what the kernel says between these files
                    os.copy_file_range(src, dst, 16, 0, 0)
            finally:
                os.close(src)
                os.close(dst)
        assert refused.value.errno in export.FALLBACK_ERRNOS
        with pagemem.Engine.load(path, tiny_gpt(7), cfg) as engine:
            assert same(everything(engine), expected)
    finally:
        shutil.rmtree(nvme, ignore_errors=True)


def test_copy_file_range_refused_with_exdev_copies_through_a_buffer(tmp_path, monkeypatch):
    def exdev(*_a):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))

    monkeypatch.setattr(os, "copy_file_range", exdev)
    monkeypatch.setattr(export, "COPY_CHUNK", 4096)  # several chunks per page
    cfg = config(str(tmp_path / "nvme"))
    with pagemem.Engine(tiny_gpt(), cfg) as engine:
        train(engine, 2)
        path = engine.save(str(tmp_path / "ckpt"))
        expected = everything(engine)
    with pagemem.Engine.load(path, tiny_gpt(7), cfg) as engine:
        assert same(everything(engine), expected)


def _nvme_only_page(engine) -> tuple[str, int]:
    """The page file and offset of a page that lives only on nvme (an Adam moment's)."""
    store = engine.store
    for i in range(len(engine.bank.params)):
        layer, k = engine.bank.where(i)
        t = layer.exp_avg[k]
        if t is None:
            continue
        for page_id, _lo, _hi in t.extents():
            copies = store.copies(page_id)
            if list(copies) == ["nvme"]:
                f, offset = store.tier("nvme").locate(copies["nvme"])
                return f.path, offset
    raise AssertionError("no page lives only on nvme")


def test_a_page_gone_bad_on_disk_fails_the_save_and_latest_stays(tmp_path):
    cfg = config(str(tmp_path / "nvme"))
    root = tmp_path / "ckpt"
    with pagemem.Engine(tiny_gpt(), cfg) as engine:
        train(engine, 1)
        first = engine.save(str(root))
        train(engine, 2)
        engine.store.synchronize()
        path, offset = _nvme_only_page(engine)
        with open(path, "r+b") as f:
            f.seek(offset + 10)
            b = f.read(1)
            f.seek(offset + 10)
            f.write(bytes([b[0] ^ 0x40]))
        with pytest.raises(pagemem.CorruptPage, match=os.path.basename(path)):
            engine.save(str(root))
    assert latest(root) == os.path.basename(first)
    assert sorted(os.listdir(root)) == ["latest", os.path.basename(first)]


def _fail_on(monkeypatch, name: str, root, code: int, only: str = "") -> list[str]:
    """``os.<name>`` raises OSError(code) on files under ``root`` (whose name contains ``only``)."""
    real = getattr(os, name)
    hits: list[str] = []

    def faulty(fd, *args, **kw):
        dst = fd if name == "write" or name == "pwrite" or name == "fsync" else args[0]
        try:
            target = os.readlink(f"/proc/self/fd/{dst}")
        except OSError:
            target = ""
        if target.startswith(str(root)) and only in os.path.basename(target):
            hits.append(target)
            raise OSError(code, os.strerror(code))
        return real(fd, *args, **kw)

    monkeypatch.setattr(os, name, faulty)
    return hits


@pytest.mark.parametrize("call,code,only", [("write", errno.ENOSPC, ""), ("pwrite", errno.ENOSPC, ""),
                                            ("copy_file_range", errno.ENOSPC, ""), ("fsync", errno.EIO, ""),
                                            ("write", errno.ENOSPC, "latest.tmp-"),
                                            ("write", errno.ENOSPC, "manifest")])
def test_a_failed_save_is_a_tier_io_error_and_leaves_nothing(tmp_path, monkeypatch, call, code, only):
    cfg = config(str(tmp_path / "nvme"))
    root = tmp_path / "ckpt"
    with pagemem.Engine(tiny_gpt(), cfg) as engine:
        train(engine, 1)
        first = engine.save(str(root))
        open(root / "latest.tmp-deadbeef", "w").close()  # left by a save that crashed
        train(engine, 2)
        hits = _fail_on(monkeypatch, call, root, code, only)
        with pytest.raises(pagemem.TierIOError) as failed:
            engine.save(str(root))
        monkeypatch.undo()
        assert hits, f"os.{call} was never called on the checkpoint"
        assert failed.value.errno == code and str(root) in str(failed.value)
        assert latest(root) == os.path.basename(first)
        assert sorted(os.listdir(root)) == ["latest", os.path.basename(first)]  # no .tmp, no new step
        second = engine.save(str(root))  # the store and engine are fine
        assert latest(root) == os.path.basename(second) and not leftovers(root)


# ------------------------------------------------------------------------- load

def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


def _truncate(path: str, keep: float) -> None:
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * keep))


def _resign(ckpt: str, change) -> None:
    """Rewrite the manifest with ``change(body)`` applied and a correct checksum."""
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        body = json.load(f)["manifest"]
    change(body)
    with open(path, "wb") as f:
        f.write(mf.encode(body))


DAMAGE = {
    "truncated manifest": ("manifest.json", lambda c, r: _truncate(os.path.join(c, "manifest.json"), 0.5)),
    "garbage manifest": ("manifest.json", lambda c, r: open(os.path.join(c, "manifest.json"), "wb").write(b"\x00\xff")),
    "step flipped in manifest": ("manifest.json", lambda c, r: _replace(os.path.join(c, "manifest.json"),
                                                                        '"global_step": 2', '"global_step": 3')),
    "lr flipped in manifest": ("manifest.json", lambda c, r: _replace(os.path.join(c, "manifest.json"),
                                                                      '"lr": 0.003', '"lr": 0.004')),
    "missing pages": ("exp_avg.pages", lambda c, r: os.unlink(os.path.join(c, "exp_avg.pages"))),
    "short pages": ("master.pages", lambda c, r: _truncate(os.path.join(c, "master.pages"), 0.75)),
    "flipped page byte": ("exp_avg_sq.pages", lambda c, r: _flip(os.path.join(c, "exp_avg_sq.pages"), 123)),
    "dangling latest": ("latest", lambda c, r: shutil.rmtree(c)),
    "garbage latest": ("latest", lambda c, r: open(os.path.join(r, "latest"), "w").write("../../etc")),
    "missing rng": ("rng.bin", lambda c, r: os.unlink(os.path.join(c, "rng.bin"))),
    "missing buffers": ("buffers.bin", lambda c, r: os.unlink(os.path.join(c, "buffers.bin"))),
    "flipped rng": ("rng.bin", lambda c, r: _flip(os.path.join(c, "rng.bin"), 7)),
    "negative step count": ("manifest.json", lambda c, r: _resign(c, lambda m: m["state"]["steps"].__setitem__(0, -1))),
    "negative lr": ("manifest.json", lambda c, r: _resign(c, lambda m: m["state"]["param_groups"][0].update(lr=-1.0))),
    "loss scale NaN": ("manifest.json", lambda c, r: _resign(c, lambda m: m["state"].update(loss_scale=float("nan")))),
    "bad shape": ("manifest.json", lambda c, r: _resign(c, lambda m: m["params"][0].update(shape=[-4, 2]))),
    "bad dtype": ("manifest.json", lambda c, r: _resign(c, lambda m: m["params"][0].update(dtype="torch.int8"))),
    "page out of its file": ("manifest.json", lambda c, r: _resign(
        c, lambda m: m["tensors"]["master"][0].update(pages=[10 ** 6]))),
    "bytes beyond the shape": ("manifest.json", lambda c, r: _resign(
        c, lambda m: m["tensors"]["master"][0].update(nbytes=m["tensors"]["master"][0]["nbytes"] + 4))),
}


def _replace(path: str, old: str, new: str) -> None:
    with open(path) as f:
        text = f.read()
    assert old in text, old
    with open(path, "w") as f:
        f.write(text.replace(old, new, 1))


def model_now(model) -> list[tuple[str, int, type, torch.Tensor]]:
    with torch._C.DisableTorchFunctionSubclass():
        return [(n, id(p), type(p), p.detach().clone()) for n, p in model.named_parameters()]


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_model_is_unchanged(saved, tmp_path, case):
    root, ckpt = copy_of(saved, tmp_path)
    name, damage = DAMAGE[case]
    damage(ckpt, root)
    model = tiny_gpt(3)
    before = model_now(model)
    with pytest.raises(pagemem.PageMemError, match=name.replace(".", r"\.")):
        pagemem.Engine.load(str(root), model, saved[1])
    after = model_now(model)
    assert [(n, i, c) for n, i, c, _ in after] == [(n, i, c) for n, i, c, _ in before]
    assert all(c is torch.nn.Parameter for _, _, c, _ in after)
    assert all(torch.equal(a[3], b[3]) for a, b in zip(after, before))


def test_a_refused_load_into_a_model_on_meta_leaves_it_on_meta(saved, tmp_path):
    root, ckpt = copy_of(saved, tmp_path)
    _flip(os.path.join(ckpt, "exp_avg_sq.pages"), 5)  # found after the engine was made
    with torch.device("meta"):
        model = GPT(GPTConfig(layers=2, hidden=64, heads=4, vocab=128, seq=16))
    ids = [id(p) for p in model.parameters()]
    with pytest.raises(pagemem.CorruptPage, match="exp_avg_sq"):
        pagemem.Engine.load(str(root), model, saved[1])
    assert [id(p) for p in model.parameters()] == ids
    assert all(p.is_meta and type(p) is torch.nn.Parameter for p in model.parameters())


def test_a_manifest_of_another_version_is_refused_clearly(saved, tmp_path):
    root, ckpt = copy_of(saved, tmp_path)
    path = os.path.join(ckpt, "manifest.json")
    with open(path) as f:
        doc = json.load(f)
    doc["version"] = mf.VERSION + 1
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(pagemem.InvalidRequest, match=f"version {mf.VERSION + 1}.*reads version {mf.VERSION}"):
        pagemem.Engine.load(str(root), tiny_gpt(), saved[1])


def test_the_loss_scaling_of_the_config_in_force_applies_on_load(saved, tmp_path):
    """An fp32 checkpoint (no loss scaling) loaded with an fp16 config scales dynamically from
    the start; the same policy on both sides keeps the saved scale."""
    root, _ = copy_of(saved, tmp_path)
    fp16 = config(str(tmp_path / "nvme"), torch.float16)
    with pagemem.Engine.load(str(root), tiny_gpt(), fp16) as engine:
        assert engine.updater.scaler.dynamic and engine.stats()["loss_scale"] == 65536.0
        assert engine.global_step == 2
        engine.updater.scaler.scale = 1024.0
        engine.save(str(root))
    with pagemem.Engine.load(str(root), tiny_gpt(), fp16) as engine:
        assert engine.stats()["loss_scale"] == 1024.0
    with pagemem.Engine.load(str(root), tiny_gpt(), saved[1]) as engine:  # back to fp32: none
        assert engine.stats()["loss_scale"] is None


# ------------------------------------------------------------------------- property

FILES = ["latest", "manifest.json", "master.pages", "exp_avg.pages", "exp_avg_sq.pages", "compute.pages",
         "rng.bin", "buffers.bin"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(FILES), truncate=st.booleans(), at=st.floats(0, 1, exclude_max=True),
       xor=st.integers(1, 255))
def test_any_damage_is_refused_or_changes_nothing(saved, tmp_path_factory, which, truncate, at, xor):
    root, ckpt = copy_of(saved, tmp_path_factory.mktemp("damaged"))
    path = os.path.join(root if which == "latest" else ckpt, which)
    size = os.path.getsize(path)
    if size == 0:  # buffers.bin of a model without buffers
        return
    if truncate:
        _truncate(path, at)
    else:
        with open(path, "r+b") as f:
            f.seek(int(size * at))
            b = f.read(1)
            f.seek(int(size * at))
            f.write(bytes([b[0] ^ xor]))
    try:
        engine = pagemem.Engine.load(str(root), tiny_gpt(7), saved[1])
    except pagemem.PageMemError:
        return
    with engine:
        assert same(everything(engine), saved[2])
