"""Weights from and to safetensors files ([Note: values from safetensors], [Note: weights files]):
a model built on ``meta`` takes its values from one file or Hugging Face's shards, trains bit for
bit as plain PyTorch from the same weights, and ``save_weights`` writes files that
``from_pretrained`` (and the engine) load back exactly; bad input is refused naming the file."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch as st
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from torch import nn

import pagemem
from exactness import assert_same, engine_config, reference
from pagemem.engine.checkpoints import safetensors_save
from pagemem.models.gpt import GPT, GPTConfig

transformers = pytest.importorskip("transformers")

V = 128
_g = torch.Generator().manual_seed(1)
TOKENS = [torch.randint(0, V, (2, 16), generator=_g) for _ in range(6)]
GPT2 = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=V, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0)


def gpt2_config():
    return transformers.GPT2Config(**GPT2)


def make_gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(gpt2_config())


def gpt2_on_meta() -> nn.Module:
    with torch.device("meta"):
        return transformers.GPT2LMHeadModel(gpt2_config())


def lm_loss(run, model, s):
    return run(input_ids=TOKENS[s], labels=TOKENS[s]).loss


def keys_of(path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def train(engine, model, loss, steps: int) -> None:
    for s in range(steps):
        engine.backward(loss(engine, model, s))
        engine.step()


def assert_loads_in_transformers(directory, want: dict[str, torch.Tensor]) -> None:
    gpt2_config().save_pretrained(directory)  # save_weights writes no config.json
    back = transformers.GPT2LMHeadModel.from_pretrained(directory)
    assert_same(want, back.state_dict())


# ------------------------------------------------------------------------ a Hugging Face GPT-2

@pytest.mark.parametrize("optimizer_tier", ["cpu", "nvme"])
def test_a_meta_gpt2_from_a_save_model_file_trains_exactly_and_saves_for_from_pretrained(tmp_path, optimizer_tier):
    """``save_model`` keeps ``lm_head.weight`` of the tied pair: the alias gives ``wte`` its value."""
    st.save_model(make_gpt2(), str(tmp_path / "twin.safetensors"))
    assert "lm_head.weight" in keys_of(tmp_path / "twin.safetensors")
    assert "transformer.wte.weight" not in keys_of(tmp_path / "twin.safetensors")
    want = reference(make_gpt2, lm_loss, 4)
    model = gpt2_on_meta()
    cfg = engine_config(make_gpt2(), lm_loss, tmp_path, optimizer_tier)
    with pagemem.Engine(model, cfg, values=tmp_path / "twin.safetensors") as engine:  # an os.PathLike
        assert model.lm_head.weight is model.transformer.wte.weight  # still tied
        train(engine, model, lm_loss, 4)
        assert engine.stats()["iterations"]["planned"] == 3
        assert_same(want, engine.state_dict())
        written = engine.save_weights(tmp_path / "out")
        got = model.state_dict()
    assert written == [str(tmp_path / "out" / "model.safetensors")]
    keys = keys_of(tmp_path / "out" / "model.safetensors")
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # tied: once, as save_pretrained
    assert sorted(keys) == sorted(k for k in got if k != "lm_head.weight")
    assert_loads_in_transformers(tmp_path / "out", got)
    assert_same(want, got)


def test_a_meta_gpt2_from_save_pretrained_shards_trains_exactly_and_saves_shards(tmp_path):
    src = tmp_path / "hf"
    make_gpt2().save_pretrained(src, max_shard_size="40KB")
    index = json.load(open(src / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) >= 2
    want = reference(make_gpt2, lm_loss, 4)
    model = gpt2_on_meta()
    with pagemem.Engine(model, engine_config(make_gpt2(), lm_loss, tmp_path), values=str(src)) as engine:
        train(engine, model, lm_loss, 4)
        assert_same(want, engine.state_dict())
        written = engine.save_weights(tmp_path / "out", max_shard_bytes="48KiB")
        got = model.state_dict()
    names = [os.path.basename(p) for p in written]
    n = len(names) - 1
    assert n >= 2 and names == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)] + [
        "model.safetensors.index.json"]
    body = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    assert list(body["weight_map"]) == [k for k in got if k != "lm_head.weight"]  # state_dict's order
    assert body["metadata"]["total_size"] == sum(got[k].numel() * 4 for k in body["weight_map"])
    assert all(os.path.getsize(p) < 48 * 1024 + 4096 or len(keys_of(p)) == 1 for p in written[:-1])
    assert_loads_in_transformers(tmp_path / "out", got)


def test_save_weights_writes_each_parameter_in_the_dtype_it_came_with(tmp_path):
    """A bf16 parameter among fp32 ones, under a bf16 compute dtype: the file holds each in the
    dtype it came with (its fp32 master weights cast: what ``close()`` gives back)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    model[1].to(torch.bfloat16)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with pagemem.Engine(model, small_config(compute_dtype=torch.bfloat16)) as engine:
        got = st.load_file(engine.save_weights(tmp_path)[0])
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in want.items()}
    assert_same(want, got)


# ------------------------------------------------------------------------ the project's GPT

GPT_CFG = GPTConfig(layers=2, hidden=64, heads=4, vocab=V, seq=32)


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_CFG)


def gpt_loss(run, model, s):
    logits = run(TOKENS[s][:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, V), TOKENS[s][:, 1:].reshape(-1))


def test_the_projects_gpt_on_meta_trains_exactly_from_its_weights_and_round_trips(tmp_path):
    st.save_model(make_gpt(), str(tmp_path / "gpt.safetensors"))
    want = reference(make_gpt, gpt_loss, 4)
    with torch.device("meta"):
        model = GPT(GPT_CFG)
    with pagemem.Engine(model, engine_config(make_gpt(), gpt_loss, tmp_path), values=str(tmp_path / "gpt.safetensors")) as engine:
        assert model.head.weight is model.wte.weight
        train(engine, model, gpt_loss, 4)
        assert_same(want, engine.state_dict())
        written = engine.save_weights(tmp_path / "out", max_shard_bytes=1)  # one tensor a shard
        got = model.state_dict()
    assert len(written) == len(got) - 1 + 1  # head.weight is wte.weight; and the index
    merged: dict[str, torch.Tensor] = {}
    for path in written[:-1]:
        merged.update(st.load_file(path))
    fresh = GPT(GPT_CFG)  # plain PyTorch reads them: every key but the tied one
    result = fresh.load_state_dict(merged, strict=False)
    assert result.missing_keys == ["head.weight"] and not result.unexpected_keys
    assert_same(got, fresh.state_dict())
    with torch.device("meta"):
        again = GPT(GPT_CFG)
    with pagemem.Engine(again, small_config(), values=tmp_path / "out") as engine:
        assert_same(got, engine.state_dict())


def test_values_are_read_one_module_at_a_time_each_tensor_once(tmp_path, monkeypatch):
    """When a module's values are read, no other parameter holds memory of its size, and every
    tensor of the file is read once (the tied one too)."""
    from pagemem.engine.units import safetensors_values as sv

    f = str(tmp_path / "gpt.safetensors")
    st.save_model(make_gpt(), f)
    with torch.device("meta"):
        model = GPT(GPT_CFG)
    calls, reads = [], []
    values, tensor = sv.FromSafetensors.values, sv.FromSafetensors._tensor

    def spy_values(self, mname, module, params):
        own = {id(p) for p in module.parameters(recurse=False)}
        for other in model.parameters():
            if id(other) not in own:
                assert other.is_meta or other.untyped_storage().nbytes() <= other.element_size(), mname
        calls.append(mname)
        return values(self, mname, module, params)

    monkeypatch.setattr(sv.FromSafetensors, "values", spy_values)
    monkeypatch.setattr(sv.FromSafetensors, "_tensor", lambda self, key: reads.append(key) or tensor(self, key))
    with pagemem.Engine(model, small_config(), values=f):
        pass
    owners = [n for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
    assert calls == [n for n in owners if n != "head"]  # head's weight is wte's: read once, for its first owner
    assert sorted(reads) == sorted(keys_of(f))


# ------------------------------------------------------------------------ round trips

def small_config(**kw) -> pagemem.EngineConfig:
    store = pagemem.StoreConfig(gpu_backend="host", page_bytes=64 << 10, gpu_bytes=16 << 20, cpu_bytes=64 << 20,
                                copy_threads=0)
    return pagemem.EngineConfig(store=store, adam_threads=1, **kw)


class Net(nn.Module):
    """Layers of random widths (bf16 ones maybe) between two square ones, tied maybe; a buffer
    persistent or not."""

    def __init__(self, widths: list[int], tie: bool, bf16: list[bool], persistent: bool) -> None:
        super().__init__()
        self.first = nn.Linear(widths[0], widths[0])
        self.layers = nn.ModuleList(nn.Linear(a, b).to(torch.bfloat16 if h else torch.float32)
                                    for a, b, h in zip(widths, widths[1:] + widths[:1], bf16))
        self.last = nn.Linear(widths[0], widths[0], bias=False)
        if tie:
            self.last.weight = self.first.weight
        self.register_buffer("count", torch.zeros(widths[0], dtype=torch.int64), persistent=persistent)
        self.register_buffer("scale", torch.ones(widths[0]))


def fill(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(model.parameters()) + [model.scale]:
            t.copy_(torch.randn(t.shape, generator=g))
        model.count.copy_(torch.randint(0, 100, model.count.shape, generator=g))
    return model


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(widths=hs.lists(hs.sampled_from([4, 8, 24]), min_size=1, max_size=3),
       tie=hs.booleans(), bf16=hs.lists(hs.booleans(), min_size=3, max_size=3), persistent=hs.booleans(),
       shard=hs.one_of(hs.integers(1, 4096), hs.just(1 << 30)), seed=hs.integers(0, 1000))
def test_save_then_load_round_trips_exactly(tmp_path_factory, widths, tie, bf16, persistent, shard, seed):
    out = tmp_path_factory.mktemp("w")
    model = fill(Net(widths, tie, bf16, persistent), seed)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with pagemem.Engine(model, small_config()) as engine:
        written = engine.save_weights(out, max_shard_bytes=shard)
    assert written[-1].endswith("model.safetensors" if len(written) == 1 else "model.safetensors.index.json")
    stored: dict[str, torch.Tensor] = {}
    for path in written:
        if path.endswith(".safetensors"):
            stored.update(st.load_file(path))
    assert set(stored) <= set(want)
    for k, v in stored.items():
        assert v.dtype == want[k].dtype and torch.equal(v, want[k]), k
    with torch.device("meta"):
        twin = Net(widths, tie, bf16, persistent)
    if not persistent:  # in no file: its value is the model's business (on meta the engine refuses it)
        twin.count = torch.zeros(widths[0], dtype=torch.int64)
    with pagemem.Engine(twin, small_config(), values=out):
        back = twin.state_dict()
        assert (twin.last.weight is twin.first.weight) == tie
    assert back.keys() == want.keys()
    for k in want:
        assert back[k].dtype == want[k].dtype and torch.equal(back[k], want[k]), k


def test_a_file_in_another_dtype_is_cast_as_load_state_dict_casts(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    st.save_file(state, str(tmp_path / "w.safetensors"))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    with pagemem.Engine(meta, small_config(), values=str(tmp_path / "w.safetensors")) as engine:
        got = engine.state_dict()
    twin = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
    twin.load_state_dict(state)
    assert_same(twin.state_dict(), got)
    assert all(v.dtype == torch.float32 for v in got.values())
    # and the other way: fp32 values into a bf16 parameter are rounded to bf16, master weights too
    st.save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)).to(torch.bfloat16)
    with pagemem.Engine(meta, small_config(), values=str(tmp_path / "w.safetensors")) as engine:
        got = engine.state_dict()  # the fp32 master weights
    twin.to(torch.bfloat16).load_state_dict(model.state_dict())
    assert_same({k: v.float() for k, v in twin.state_dict().items()}, got)


def test_saving_again_switches_layouts_and_leaves_other_files(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    out = tmp_path / "w"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pagemem.Engine(model, small_config()) as engine:
        engine.save_weights(out, max_shard_bytes=1024)
        assert sorted(os.listdir(out)) == ["config.json", *(f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)),
                                           "model.safetensors.index.json"]
        engine.save_weights(out, max_shard_bytes=4096 + 128)  # a layer's weight and bias
        assert sorted(os.listdir(out)) == ["config.json", "model-00001-of-00002.safetensors",
                                           "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
        engine.save_weights(out)
        assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
        engine.save_weights(out, max_shard_bytes="1KiB")
        assert sorted(os.listdir(out)) == ["config.json", *(f"model-0000{k}-of-00004.safetensors" for k in range(1, 5)),
                                           "model.safetensors.index.json"]
        want = engine.state_dict()
    assert (out / "config.json").read_text() == "{}"
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with pagemem.Engine(meta, small_config(), values=out) as engine:
        assert_same(want, engine.state_dict())


# ------------------------------------------------------------------------ bad input, refused by name

class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.b.weight = nn.Parameter(torch.zeros(4, 8))
        self.register_buffer("shift", torch.zeros(8))


def small_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v.clone() for k, v in Small().state_dict().items()}


def refused(values, match: str, model: nn.Module | None = None) -> None:
    """``values`` is refused with ``match``, and the model built on meta is untouched (nothing was
    allocated: its parameters are still on meta)."""
    if model is None:
        with torch.device("meta"):
            model = Small()
    with pytest.raises(pagemem.ConfigError, match=match):
        pagemem.Engine(model, small_config(), values=values)
    assert all(p.is_meta for p in model.parameters())


def test_a_missing_tensor_is_refused_naming_the_file_and_keys(tmp_path):
    f = str(tmp_path / "w.safetensors")
    st.save_file({k: v for k, v in small_state().items() if k not in ("a.bias", "shift")}, f)
    refused(f, rf"{f} has no tensor for 2 of the model's key\(s\): 'a.bias', 'shift'")


def test_many_missing_tensors_are_listed_a_few(tmp_path):
    with torch.device("meta"):
        model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(6)))
    f = str(tmp_path / "w.safetensors")
    st.save_file({"0.weight": torch.zeros(2, 2)}, f)
    refused(f, r"11 of the model's key\(s\): '0.bias', '1.weight', .* and 6 more$", model)


def test_a_tensor_the_model_does_not_have_is_refused_naming_it(tmp_path):
    f = str(tmp_path / "w.safetensors")
    st.save_file({**small_state(), "transformer.extra": torch.zeros(1)}, f)
    refused(f, rf"{f} holds 1 tensor\(s\) the model does not have: 'transformer.extra'")


def test_a_shape_mismatch_is_refused_naming_the_file_the_key_and_both_shapes(tmp_path):
    f = str(tmp_path / "w.safetensors")
    st.save_file({**small_state(), "b.weight": torch.zeros(8, 4)}, f)
    refused(f, rf"{f}: 'b.weight' has shape \(8, 4\), the model's 'b.weight' has \(4, 8\)")
    st.save_file({**small_state(), "shift": torch.zeros(9)}, f)  # a buffer too
    refused(f, r"'shift' has shape \(9,\)")


def test_paths_that_hold_no_weights_are_refused(tmp_path):
    refused(str(tmp_path / "nowhere"), "nowhere does not exist")
    refused(tmp_path, "holds neither model.safetensors nor model.safetensors.index.json")
    refused(42, "must be a state dict .* or the path of safetensors weights, got int")


def test_a_corrupt_or_truncated_file_is_refused_naming_it(tmp_path):
    f = tmp_path / "model.safetensors"
    st.save_file(small_state(), str(f))
    whole = f.read_bytes()
    f.write_bytes(whole[:-16])
    refused(tmp_path, rf"{f}: not a readable safetensors file \(.*incomplete")
    f.write_bytes(b"\xff" * 64)
    refused(str(f), rf"{f}: not a readable safetensors file")
    f.write_bytes(b"")
    refused(str(f), rf"{f}: not a readable safetensors file")


def write_shards(folder, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """``state`` as two shards and their index (written by hand); returns the weight map."""
    keys = list(state)
    halves = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    weight_map = {}
    for name, part in halves.items():
        st.save_file({k: state[k] for k in part}, str(folder / name))
        weight_map.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return weight_map


def test_a_sharded_directory_loads_and_its_faults_are_refused_naming_the_file(tmp_path):
    state = small_state()
    weight_map = write_shards(tmp_path, state)
    with torch.device("meta"):
        model = Small()
    with pagemem.Engine(model, small_config(), values=tmp_path) as engine:
        assert_same(state, engine.state_dict())
    index = tmp_path / "model.safetensors.index.json"
    os.rename(tmp_path / "model-00002-of-00002.safetensors", tmp_path / "gone")
    refused(tmp_path, rf"{index} names 1 shard\(s\) that are not there: model-00002-of-00002.safetensors")
    os.rename(tmp_path / "gone", tmp_path / "model-00002-of-00002.safetensors")
    assert weight_map["b.bias"] == "model-00002-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": dict(weight_map, **{"b.bias": "model-00001-of-00002.safetensors"})}))
    refused(str(index), r"puts 'b.bias' in model-00001-of-00002.safetensors, which does not hold it")
    index.write_text(json.dumps({"weight_map": dict(weight_map, shift="../elsewhere.safetensors")}))
    refused(tmp_path, r"'shift' lies in '../elsewhere.safetensors', not a file name beside the index")
    index.write_text("{not json")
    refused(tmp_path, rf"{index}: not a readable JSON index")
    index.write_text(json.dumps({"metadata": {}}))
    refused(tmp_path, rf"{index}: no \"weight_map\"")


def test_tied_aliases_stored_twice_must_agree(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.emb.weight

    f = str(tmp_path / "w.safetensors")
    w = torch.randn(8, 4)
    st.save_file({"emb.weight": w, "head.weight": w.clone()}, f)
    with torch.device("meta"):
        model = Tied()
    with pagemem.Engine(model, small_config(), values=f) as engine:
        assert torch.equal(engine.state_dict()["head.weight"], w)
    st.save_file({"emb.weight": w, "head.weight": w + 1}, f)
    with torch.device("meta"):
        model = Tied()
    with pytest.raises(pagemem.ConfigError, match=r"tied tensors 'emb.weight' and 'head.weight' with different"):
        pagemem.Engine(model, small_config(), values=f)


def test_a_model_off_meta_takes_the_files_values_too(tmp_path):
    state = small_state()
    st.save_file(state, str(tmp_path / "model.safetensors"))
    model = Small()
    with pagemem.Engine(model, small_config(), values=str(tmp_path)) as engine:
        assert_same(state, engine.state_dict())


def test_bad_shard_sizes_are_refused(tmp_path):
    with pagemem.Engine(Small(), small_config()) as engine:
        for bad in (0, -1, "lots", 1.5):
            with pytest.raises(pagemem.ConfigError, match="max_shard_bytes"):
                engine.save_weights(tmp_path, max_shard_bytes=bad)
    assert os.listdir(tmp_path) == []


def test_save_weights_is_one_call_waiting_for_the_running_one(tmp_path, monkeypatch):
    """[Note: calls from several threads]: a save from a second thread waits for the call that
    holds the engine, then runs whole, holding the engine's call lock while it writes."""
    import threading

    with pagemem.Engine(Small(), small_config()) as engine:
        held, release, done, holding = threading.Event(), threading.Event(), [], []
        real = safetensors_save.write_shard

        def write_shard(path, tensors):
            holding.append((engine.calls._owner is threading.current_thread(), engine.calls._what))
            real(path, tensors)

        monkeypatch.setattr(safetensors_save, "write_shard", write_shard)

        def hold() -> None:
            with engine.calls.held("another call"):
                held.set()
                release.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        assert held.wait(30)
        saver = threading.Thread(target=lambda: done.append(engine.save_weights(tmp_path)))
        saver.start()
        saver.join(0.5)
        assert not done and not os.listdir(tmp_path)  # it waits, having written nothing
        release.set()
        saver.join(30)
        holder.join(30)
        assert done == [[str(tmp_path / "model.safetensors")]]
        assert holding == [(True, "save_weights")]


# ------------------------------------------------------------------------ a save that fails part-way

@pytest.mark.parametrize("before", ["nothing", "single", "shards"])
def test_a_save_failing_part_way_leaves_what_was_there_and_the_engine_trains_on(tmp_path, monkeypatch, before):
    """The writer raises on the 2nd shard: no file that looks like weights appears (no
    ``model.safetensors``, no index, no shard), what an earlier save wrote is untouched, no
    temporary directory is left, and the engine trains and saves again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    out = tmp_path / "w"
    x = torch.randn(4, 16)
    with pagemem.Engine(model, small_config(optimizer=pagemem.AdamW(lr=1e-2))) as engine:
        if before != "nothing":
            engine.save_weights(out, max_shard_bytes=1 << 20 if before == "single" else 1)
        there = {n: (out / n).read_bytes() for n in os.listdir(out)} if out.exists() else {}
        real, calls = safetensors_save.write_shard, []

        def fails_second(path, tensors):
            calls.append(path)
            if len(calls) == 2:
                raise pagemem.TierIOError(f"save_weights: writing {path} failed (planted)")
            real(path, tensors)

        monkeypatch.setattr(safetensors_save, "write_shard", fails_second)
        with pytest.raises(pagemem.TierIOError, match="planted"):
            engine.save_weights(out, max_shard_bytes=16 * 16 * 4)
        assert len(calls) == 2
        assert {n: (out / n).read_bytes() for n in os.listdir(out)} == there
        monkeypatch.setattr(safetensors_save, "write_shard", real)
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        written = engine.save_weights(out, max_shard_bytes=16 * 16 * 4)
        want = engine.state_dict()
    assert sorted(os.listdir(out)) == sorted(os.path.basename(p) for p in written)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    with pagemem.Engine(meta, small_config(), values=out) as engine:
        assert_same(want, engine.state_dict())


def test_a_crashed_saves_temporary_directory_is_removed_by_the_next(tmp_path):
    (tmp_path / ".save_weights.tmp-0badf00d").mkdir()
    (tmp_path / ".save_weights.tmp-0badf00d" / "model.safetensors").write_bytes(b"half")
    with pagemem.Engine(Small(), small_config()) as engine:
        engine.save_weights(tmp_path)
    assert os.listdir(tmp_path) == ["model.safetensors"]


# ------------------------------------------------------------------------ pagemem train --model.hf DIR

def test_pagemem_train_starts_from_a_directorys_safetensors_weights(tmp_path):
    from tests.conftest import exit_status
    from pagemem.commands.train_config import layered, resolve

    d = tmp_path / "tiny-gpt2"
    torch.manual_seed(11)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=96, n_positions=32, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    saved = transformers.GPT2LMHeadModel(cfg)
    saved.save_pretrained(d, max_shard_size="100KB")  # shards
    assert (d / "model.safetensors.index.json").exists()
    flags = {"model.hf": str(d), "data.vocab": "64", "data.seq": "16", "data.batch": "8", "store.page_bytes": "64KiB",
             "train.progress": "false", "train.runs": str(tmp_path / "runs"), "train.steps": "2", "train.name": "w"}
    assert exit_status("train", *(a for k, v in flags.items() for a in (f"--{k}", v))) == 0
    first = json.loads(open(tmp_path / "runs" / "w" / "metrics.jsonl").readline())["loss"]
    run_cfg = resolve(layered([], flags), str(tmp_path / "runs" / "w"))
    batch = run_cfg.data.batch_at(0, run_cfg.data.table())
    with torch.no_grad():
        want = saved(input_ids=batch, labels=batch).loss.item()
        torch.manual_seed(0)
        fresh = transformers.GPT2LMHeadModel(cfg)(input_ids=batch, labels=batch).loss.item()
    assert first == pytest.approx(want, rel=1e-5) and first != pytest.approx(fresh, rel=1e-3)


def test_a_directorys_model_is_built_with_its_parameters_on_meta_and_its_buffers_made(tmp_path):
    """A Llama's rotary ``inv_freq`` is in no weights file: it is made as the model's code makes
    it, while every parameter waits on meta for the files' values."""
    from pagemem.commands.models import build
    from pagemem.commands.train_config import ModelSettings

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    saved = transformers.LlamaForCausalLM(cfg)
    saved.save_pretrained(tmp_path)
    built = build(ModelSettings(hf=str(tmp_path)), seed=0)
    assert built.values == str(tmp_path)
    assert all(p.is_meta and p.dtype == torch.float32 for p in built.model.parameters())
    buffers = dict(built.model.named_buffers())
    assert buffers and not any(b.is_meta for b in buffers.values())
    assert torch.equal(buffers["model.rotary_emb.inv_freq"], dict(saved.named_buffers())["model.rotary_emb.inv_freq"])
    with pagemem.Engine(built.model, small_config(), values=built.values) as engine:
        assert_same(saved.state_dict(), engine.state_dict())
        tokens = TOKENS[0]
        with torch.no_grad():
            assert torch.equal(engine(input_ids=tokens).logits, saved(input_ids=tokens).logits)
    stand_in = build(ModelSettings(hf=str(tmp_path)), seed=0, weights=False)
    assert stand_in.values is None and not any(p.is_meta for p in stand_in.model.parameters())
