"""The tokens of ``data.path`` (``train_data``): a text file or directory through a Hugging
Face tokenizer, a token file by memory map, or a dataset saved by ``datasets``. Never downloads.

[Note: reading a corpus] Text is tokenized at every start (a resume included), in memory, with
the tokenizer's end-of-text token after each document; the same tokenizer gives the same ids,
so the batches resume exactly. A token file is never read whole: ``numpy.memmap`` pages in the
windows a batch takes (nanoGPT's ``train.bin``/``val.bin``: raw ``uint16`` ids, the file
nanoGPT's ``prepare.py`` and LitGPT's nanoGPT-style preparation write); LitGPT's pretraining
data, litdata's optimized chunks, is mapped the same way ([Note: litdata's token chunks]).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagemem.errors import ConfigError

TEXT_SUFFIXES = (".txt", ".md", ".text", ".rst", ".jsonl", ".json", ".csv", ".tsv", ".py", ".html", "")
"""Files of a text directory that are read (others, hidden files too, are skipped)."""
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")


@dataclass(frozen=True)
class Windows:
    """``count`` windows of ``seq + 1`` tokens of a stream, window ``k`` at ``k * seq``."""

    tokens: Any
    seq: int

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq)

    def window(self, k: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(self.tokens[k * self.seq:k * self.seq + self.seq + 1], dtype=np.int64))


@dataclass(frozen=True)
class Corpus:
    """A stream of training tokens, and a validation stream where the data has its own."""

    train: Any
    val: Any | None
    vocab: int | None
    """The tokenizer's vocabulary size (None: a token file's, unknown)."""

    @property
    def train_tokens(self) -> int:
        return len(self.train)

    def split(self, seq: int, validation: float) -> tuple[Windows, Windows]:
        """Training and validation windows ([Note: batches of your own data])."""
        if self.val is not None and validation == 0:
            return Windows(self.train, seq), Windows(self.val, seq)
        whole = Windows(self.train, seq)
        held = int(round(len(whole) * validation))
        if validation and held == 0 and len(whole) > 1:
            held = 1
        cut = (len(whole) - held) * seq
        return Windows(self.train[:cut + 1], seq), Windows(self.train[cut:], seq)


def load_corpus(data: Any, model_dir: str | None) -> Corpus:
    """``data.path``'s tokens (``data``: ``DataSettings``; ``model_dir``: ``model.hf`` when it is a
    directory, whose tokenizer text uses when ``data.tokenizer`` is not given)."""
    path = data.path
    if not os.path.exists(path):
        raise ConfigError(f"data.path: {path} does not exist")
    kind = data.format if data.format != "auto" else _guess(path)
    if kind == "tokens":
        return _token_file(path, data.token_dtype)
    if kind == "litdata":
        from pagemem.commands.train_litdata import litdata_streams

        return Corpus(*litdata_streams(path), None)
    if kind == "dataset":
        return _dataset(path, data, model_dir)
    tokenizer = Tokenizer.load(data.tokenizer, model_dir)
    return Corpus(tokenizer.encode_documents(_text_documents(path)), None, tokenizer.vocab)


def _guess(path: str) -> str:
    if os.path.isfile(path):
        return "tokens" if path.endswith(".bin") else "text"
    if os.path.isfile(os.path.join(path, "train.bin")):
        return "tokens"
    from pagemem.commands.train_litdata import is_litdata

    if is_litdata(path):
        return "litdata"
    if any(os.path.isfile(os.path.join(path, n)) for n in ("dataset_info.json", "dataset_dict.json", "state.json")):
        return "dataset"
    return "text"


def _token_file(path: str, dtype: str) -> Corpus:
    val = None
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "val.bin")):
            val = _memmap(os.path.join(path, "val.bin"), dtype)
        path = os.path.join(path, "train.bin")
        if not os.path.isfile(path):
            raise ConfigError(f"data.path: {os.path.dirname(path)} has no train.bin (a token directory's layout)")
    return Corpus(_memmap(path, dtype), val, None)


def _memmap(path: str, dtype: str) -> Any:
    size = os.path.getsize(path)
    item = np.dtype(dtype).itemsize
    if size % item:
        raise ConfigError(f"data.token_dtype: {path} is {size} bytes, not a whole number of {dtype} tokens "
                          f"(give data.token_dtype uint16 or uint32)")
    if size == 0:
        raise ConfigError(f"data.path: {path} is empty")
    return np.memmap(path, dtype=dtype, mode="r")


def _text_documents(path: str) -> list[str]:
    if os.path.isfile(path):
        files = [path]
    else:
        files = sorted(os.path.join(root, n) for root, _, names in os.walk(path) for n in names
                       if os.path.splitext(n)[1].lower() in TEXT_SUFFIXES
                       and not any(p.startswith(".") for p in os.path.relpath(os.path.join(root, n), path).split(os.sep)))
    docs = []
    for f in files:
        try:
            with open(f, encoding="utf-8") as fh:
                docs.append(fh.read())
        except UnicodeDecodeError:
            raise ConfigError(f"data.path: {f} is not UTF-8 text (give data.format tokens for a token file)") from None
    docs = [d for d in docs if d]
    if not docs:
        raise ConfigError(f"data.path: {path} holds no text (files ending {', '.join(s for s in TEXT_SUFFIXES if s)})")
    return docs


def _dataset(path: str, data: Any, model_dir: str | None) -> Corpus:
    try:
        import datasets
    except ImportError:
        raise ConfigError("data.path: a saved dataset needs the datasets package (pip install datasets)") from None
    try:
        loaded = datasets.load_from_disk(path)
    except Exception as exc:  # datasets raises FileNotFoundError or its own errors
        raise ConfigError(f"data.path: {path} is not a dataset saved by save_to_disk ({exc})") from None
    val_split = None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(f"data.path: {path} has splits {', '.join(loaded)}, none named train")
        val_split = next((loaded[s] for s in ("validation", "test") if s in loaded), None)
        loaded = loaded["train"]
    if "input_ids" in loaded.column_names:
        def ids(ds: Any) -> Any:
            return np.concatenate([np.asarray(r, dtype=np.int64) for r in ds["input_ids"]])
        return Corpus(ids(loaded), ids(val_split) if val_split is not None else None, None)
    if data.text_key not in loaded.column_names:
        raise ConfigError(f"data.text_key: {path} has no column {data.text_key!r} (columns: "
                          f"{', '.join(loaded.column_names)})")
    tokenizer = Tokenizer.load(data.tokenizer, model_dir)

    def encoded(ds: Any) -> Any:
        return tokenizer.encode_documents([t for t in ds[data.text_key] if t])

    return Corpus(encoded(loaded), encoded(val_split) if val_split is not None else None, tokenizer.vocab)


class Tokenizer:
    """A Hugging Face fast tokenizer (the ``tokenizers`` library underneath) from local files."""

    def __init__(self, backend: Any, eos: int | None) -> None:
        self.backend, self.eos = backend, eos
        self.vocab = int(backend.get_vocab_size(with_added_tokens=True))

    @classmethod
    def load(cls, given: str | None, model_dir: str | None) -> "Tokenizer":
        where = given or model_dir
        field = "data.tokenizer" if given else "model.hf"
        if where is None:
            raise ConfigError("data.tokenizer: text needs a tokenizer: give data.tokenizer (a tokenizer.json file or "
                              "a directory), or a model.hf directory that holds one")
        if os.path.isfile(where):
            return cls._from_file(where, field)
        if not os.path.isdir(where):
            raise ConfigError(f"{field}: {where} does not exist")
        try:
            import transformers

            tok = transformers.AutoTokenizer.from_pretrained(where, local_files_only=True)
            if getattr(tok, "backend_tokenizer", None) is None:
                raise ConfigError(f"{field}: {where} holds a slow tokenizer only; save a fast one (tokenizer.json)")
            return cls(tok.backend_tokenizer, tok.eos_token_id)
        except ImportError:
            pass
        except (OSError, ValueError) as exc:
            if not os.path.isfile(os.path.join(where, "tokenizer.json")):
                raise ConfigError(f"{field}: {where} holds no tokenizer transformers can load ({exc})") from None
        if os.path.isfile(os.path.join(where, "tokenizer.json")):
            return cls._from_file(os.path.join(where, "tokenizer.json"), field)
        raise ConfigError(f"{field}: {where} has no tokenizer.json")

    @classmethod
    def _from_file(cls, path: str, field: str) -> "Tokenizer":
        try:
            import tokenizers
        except ImportError:
            raise ConfigError(f"{field}: needs the tokenizers package (pip install tokenizers)") from None
        try:
            backend = tokenizers.Tokenizer.from_file(path)
        except Exception as exc:  # tokenizers raises its own Exception subclass
            raise ConfigError(f"{field}: {path} is not a tokenizer.json ({exc})") from None
        eos = next((backend.token_to_id(n) for n in EOS_NAMES if backend.token_to_id(n) is not None), None)
        return cls(backend, eos)

    def encode_documents(self, docs: list[str]) -> Any:
        """Every document's ids, each followed by the end-of-text token (where there is one)."""
        out: list[np.ndarray] = []
        for enc in self.backend.encode_batch(docs, add_special_tokens=False):
            out.append(np.asarray(enc.ids, dtype=np.int64))
            if self.eos is not None:
                out.append(np.asarray([self.eos], dtype=np.int64))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
