"""LitGPT's pretraining data (litdata's optimized chunks, [Note: litdata's token chunks]),
written here byte for byte as litdata's writer lays them out: read by memory map without
litdata, the same batches as the same tokens in a token file (packing, the seeded shuffle,
resume mid-epoch), ``train/`` and ``val/``, and every damaged directory named in one line."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.commands.train_data import Batches, DataSettings

INT32 = 16  # litdata's index of torch.int (what LitGPT's tokenizer returns)


def write_chunk(path, docs: list[np.ndarray]) -> int:
    """One chunk file: uint32 item count, item_count + 1 absolute uint32 offsets, the items."""
    sizes = [d.nbytes for d in docs]
    header = (len(docs) + 2) * 4
    offsets = (np.concatenate([[0], np.cumsum(sizes)]) + header).astype("<u4")
    data = np.uint32(len(docs)).tobytes() + offsets.tobytes() + b"".join(d.tobytes() for d in docs)
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def write_litdata(directory, chunks: list[list[np.ndarray]], dtype_index: int = INT32, **config) -> None:
    """A directory as litdata's ``optimize(..., item_loader=TokensLoader())`` writes it."""
    os.makedirs(directory, exist_ok=True)
    info = []
    for i, docs in enumerate(chunks):
        name = f"chunk-0-{i}.bin"
        write_chunk(os.path.join(directory, name), docs)
        info.append({"chunk_bytes": sum(d.nbytes for d in docs), "chunk_size": len(docs), "dim": sum(len(d) for d in docs),
                     "filename": name})
    cfg = {"chunk_bytes": 1 << 26, "chunk_size": None, "compression": None,
           "data_format": [f"no_header_tensor:{dtype_index}"], "data_spec": None, "encryption": None,
           "item_loader": "TokensLoader", **config}
    with open(os.path.join(directory, "index.json"), "w") as f:
        json.dump({"chunks": info, "config": cfg, "updated_at": "0"}, f, sort_keys=True)


def documents(rng, n_docs: int, vocab: int = 64) -> list[np.ndarray]:
    return [rng.integers(0, vocab, int(rng.integers(1, 40))).astype(np.int32) for _ in range(n_docs)]


def batches(path, **kw) -> Batches:
    return Batches(DataSettings(path=str(path), seq=8, batch=4, seed=3, **kw), vocab_limit=64)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.lists(st.integers(0, 30), min_size=1, max_size=6))
def test_the_chunks_give_the_batches_the_same_tokens_give_as_a_token_file(tmp_path_factory, seed, per_chunk):
    tmp = tmp_path_factory.mktemp("l")
    rng = np.random.default_rng(seed)
    chunks = [documents(rng, n) for n in per_chunk]
    stream = np.concatenate([d for docs in chunks for d in docs] or [np.zeros(0, np.int32)])
    if len(stream) < 9 * 4:
        return
    write_litdata(tmp / "lit", chunks)
    stream.astype(np.uint32).tofile(tmp / "tokens.bin")
    lit, bin_ = batches(tmp / "lit"), batches(tmp / "tokens.bin", token_dtype="uint32")
    assert bin_.corpus is not None and len(lit._train) == len(bin_._train)
    for i in range(0, 3 * len(lit._train) // 4 + 2):  # past an epoch: the seeded shuffle of the next
        assert np.array_equal(lit.train(i).numpy(), bin_.train(i).numpy())
    again = batches(tmp / "lit")  # a resumed run: batch i from nothing but i
    assert np.array_equal(again.train(5).numpy(), lit.train(5).numpy())


def test_litgpt_train_and_val_directories(tmp_path):
    rng = np.random.default_rng(0)
    write_litdata(tmp_path / "d" / "train", [documents(rng, 20), documents(rng, 20)])
    val = documents(rng, 10)
    write_litdata(tmp_path / "d" / "val", [val])
    b = batches(tmp_path / "d")
    assert b.has_validation and np.array_equal(b.validation(0)[0].numpy(), np.concatenate(val)[:9])


@pytest.mark.parametrize("damage,needle", [
    ("empty", "has no index.json"),
    ("bad json", "cannot read"),
    ("no chunks", "is not a litdata index"),
    ("truncated", "a truncated chunk"),
    ("missing chunk", "cannot read"),
    ("compressed", "compressed (zstd)"),
    ("pickled items", "not token ids written with TokensLoader"),
    ("float tokens", "not token ids written with TokensLoader"),
    ("wrong header", "header does not match its index"),
    ("escaping name", "a chunk entry litdata's TokensLoader cannot read"),
    ("negative ids", "is negative"),
])
def test_a_damaged_litdata_directory_is_named(tmp_path, damage, needle):
    rng = np.random.default_rng(1)
    d = tmp_path / "lit"
    write_litdata(d, [documents(rng, 30)], **({"compression": "zstd"} if damage == "compressed" else {}))
    index = json.loads((d / "index.json").read_text())
    chunk = d / "chunk-0-0.bin"
    if damage == "empty":
        os.remove(d / "index.json")
        os.remove(chunk)
    elif damage == "bad json":
        (d / "index.json").write_text("{")
    elif damage == "no chunks":
        (d / "index.json").write_text(json.dumps({"config": index["config"]}))
    elif damage == "truncated":
        os.truncate(chunk, os.path.getsize(chunk) - 3)
    elif damage == "missing chunk":
        os.remove(chunk)
    elif damage in ("pickled items", "float tokens", "escaping name"):
        if damage == "escaping name":
            index["chunks"][0]["filename"] = "../chunk-0-0.bin"
        else:
            index["config"]["data_format"] = ["pickle"] if damage == "pickled items" else ["no_header_tensor:0"]
        (d / "index.json").write_text(json.dumps(index))
    elif damage == "wrong header":
        with open(chunk, "r+b") as f:
            f.write(np.uint32(7).tobytes())
    elif damage == "negative ids":
        write_litdata(d, [[np.full(40, -5, np.int32)]])
    fmt = {"format": "litdata"} if damage == "empty" else {}
    with pytest.raises(pagemem.ConfigError) as exc:
        b = batches(d, **fmt)
        b.train(0)
    message = str(exc.value)
    assert message.startswith("data.path: ") and needle in message and "\n" not in message, message


def test_litdata_itself_reads_what_the_test_writes_where_it_is_installed(tmp_path):
    litdata = pytest.importorskip("litdata")
    rng = np.random.default_rng(2)
    docs = documents(rng, 30)
    write_litdata(tmp_path / "lit", [docs[:15], docs[15:]])
    ds = litdata.StreamingDataset(str(tmp_path / "lit"), item_loader=litdata.TokensLoader(block_size=9))
    ours = batches(tmp_path / "lit")
    stream = np.asarray(ours.corpus.train)
    first = ds[0].numpy()
    assert np.array_equal(first, stream[:9])


@pytest.mark.slow
def test_a_litdata_directory_trains(tmp_path):
    from tests.test_cmd_train_real import SMALL, pagemem_cmd

    rng = np.random.default_rng(3)
    write_litdata(tmp_path / "d" / "train", [documents(rng, 100), documents(rng, 100)])
    write_litdata(tmp_path / "d" / "val", [documents(rng, 20)])
    r = pagemem_cmd(tmp_path, "train", *SMALL, "--data.path", str(tmp_path / "d"), "--train.steps", "4",
                    "--train.eval_every", "2", "--train.name", "l")
    assert r.returncode == 0, r.stderr
    metrics = [json.loads(line) for line in open(tmp_path / "runs" / "l" / "metrics.jsonl")]
    assert len(metrics) == 4 and metrics[1]["val_loss"] is not None
