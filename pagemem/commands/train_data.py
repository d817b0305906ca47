"""``pagemem train``'s ``[data]``: the synthetic task, or your own tokens, in batches that are a
pure function of the step.

[Note: batches of your own data] The tokens of a corpus (``train_corpus``: a text file or
directory through a tokenizer, a token file read by memory map, a dataset saved with
``datasets``) are one stream, documents packed end to end (an end-of-text token between them
where the tokenizer has one). Window ``k`` is tokens ``[k * seq, k * seq + seq]`` (``seq`` inputs and
their ``seq`` targets); the last ``validation`` of the windows (or, where the corpus has its own
validation part, that part's windows) are held out. Training reads the other windows epoch after
epoch, each epoch in its own seeded order (``torch.randperm`` seeded by ``seed`` and the epoch),
so batch ``i`` (counted in micro-batches: ``step * accumulation_steps + micro``) is a pure
function of ``i``: a resumed run reads exactly the batches an uninterrupted one would, mid-epoch
too, with nothing saved but the step. With several ranks each takes its rows of the combined
batch, as the synthetic task does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pagemem.checks import check_choice, check_int
from pagemem.errors import ConfigError
from pagemem.models.tasks import BranchingTask

FORMATS = ("auto", "text", "tokens", "dataset", "litdata")
TOKEN_DTYPES = ("uint16", "uint32")
VALIDATION_OFFSET = 1 << 40
"""The synthetic task's validation batches: batch indices from here on, which training never reaches."""


@dataclass(frozen=True)
class DataSettings(BranchingTask):
    """The ``[data]`` section: batch shape, the data order, and the data (the synthetic
    branching task unless ``path`` is given; ``vocab`` and ``branches`` are the task's only)."""

    path: str | None = None
    """Your data: a text file, a directory of text files, a token file (``.bin``; a directory
    with ``train.bin`` and, optionally, ``val.bin``: nanoGPT's layout), a directory litdata's
    ``optimize`` wrote with ``TokensLoader`` (``index.json`` and chunks, or ``train/`` and ``val/``
    holding them: LitGPT's pretraining layout) or a directory a ``datasets`` dataset was saved to
    (``save_to_disk``); None: the synthetic task."""
    format: str = "auto"
    """How to read ``path``: ``text``, ``tokens``, ``litdata``, ``dataset``, or ``auto`` (a ``.bin``
    file or a directory with ``train.bin``: tokens; with ``index.json`` or ``train/index.json``:
    litdata; with ``dataset_info.json`` or ``dataset_dict.json``: dataset; else text)."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer for text: a ``tokenizer.json`` file or a directory
    (``transformers.AutoTokenizer``); None: ``model.hf``'s directory. Never downloaded."""
    token_dtype: str = "uint16"
    """The integer type of a token file: ``uint16`` (vocabularies up to 65536) or ``uint32`` (litdata's
    index names its own)."""
    text_key: str = "text"
    """A dataset's column of text (a column ``input_ids`` is used as tokens instead)."""
    validation: float = 0.0
    """The fraction of the windows held out for evaluation (``train.eval_every``), from the end
    of the stream; 0: none, unless the data has its own validation part (``val.bin``, a
    ``validation`` or ``test`` split). The synthetic task always has held-out batches."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.path is not None and (not isinstance(self.path, str) or not self.path):
            raise ConfigError(f"path: must be a file or directory path, got {self.path!r}")
        check_choice("format", self.format, FORMATS)
        if self.tokenizer is not None and (not isinstance(self.tokenizer, str) or not self.tokenizer):
            raise ConfigError(f"tokenizer: must be a tokenizer.json file or a directory, got {self.tokenizer!r}")
        check_choice("token_dtype", self.token_dtype, TOKEN_DTYPES)
        if not isinstance(self.text_key, str) or not self.text_key:
            raise ConfigError(f"text_key: must be a column name, got {self.text_key!r}")
        v = self.validation
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise ConfigError(f"validation: must be a fraction in [0, 1), got {v!r}")

    @property
    def synthetic(self) -> bool:
        return self.path is None

    @property
    def floor(self) -> float | None:  # type: ignore[override]
        """The synthetic task's least loss (nats); None for your own data."""
        return math.log(self.branches) if self.synthetic else None


class Batches:
    """Training and validation batches of ``[batch, seq + 1]`` token ids for one rank (see
    [Note: batches of your own data])."""

    def __init__(self, data: DataSettings, rank: int = 0, world_size: int = 1, tokenizer_dir: str | None = None,
                 vocab_limit: int | None = None) -> None:
        self.data, self.rank, self.world_size = data, rank, world_size
        self._table = data.table() if data.synthetic else None
        self.corpus: Any = None
        if not data.synthetic:
            from pagemem.commands.train_corpus import load_corpus

            self.corpus = load_corpus(data, tokenizer_dir)
            self._train, self._val = self.corpus.split(data.seq, data.validation)
            if len(self._train) == 0:
                raise ConfigError(f"data.path: {data.path} holds {self.corpus.train_tokens} tokens, fewer than one "
                                  f"sequence of data.seq + 1 = {data.seq + 1} (lower data.seq, or give more data)")
            if vocab_limit is not None and self.corpus.vocab is not None and self.corpus.vocab > vocab_limit:
                raise ConfigError(f"data.tokenizer: its vocabulary ({self.corpus.vocab} tokens) is larger than the "
                                  f"model's ({vocab_limit}); raise model.vocab, or use the model's tokenizer")
        self.vocab_limit = vocab_limit
        self._perm: tuple[int, torch.Tensor] | None = None

    @property
    def has_validation(self) -> bool:
        return self.data.synthetic or len(self._val) > 0

    @property
    def validation_windows(self) -> int | None:
        """Windows held out (None: the synthetic task, whose held-out batches never run out)."""
        return None if self.data.synthetic else len(self._val)

    def train(self, i: int) -> torch.Tensor:
        """Micro-batch ``i``'s rows for this rank."""
        if self._table is not None:
            return self.data.batch_at(i, table=self._table, rank=self.rank, world_size=self.world_size)
        n = self.data.batch * self.world_size
        first = i * n + self.rank * self.data.batch
        windows = [self._window_in_epoch(p) for p in range(first, first + self.data.batch)]
        return self._rows(self._train, windows)

    def validation(self, k: int) -> torch.Tensor:
        """Validation batch ``k`` for this rank (the held-out windows in order, round and round)."""
        if self._table is not None:
            return self.data.batch_at(VALIDATION_OFFSET + k, table=self._table, rank=self.rank,
                                      world_size=self.world_size)
        n = self.data.batch * self.world_size
        first = k * n + self.rank * self.data.batch
        return self._rows(self._val, [p % len(self._val) for p in range(first, first + self.data.batch)])

    def _window_in_epoch(self, p: int) -> int:
        epoch, at = divmod(p, len(self._train))
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed((self.data.seed << 20) + epoch)
            self._perm = (epoch, torch.randperm(len(self._train), generator=g))
        return int(self._perm[1][at])

    def _rows(self, windows: Any, which: list[int]) -> torch.Tensor:
        x = torch.stack([windows.window(k) for k in which])
        if int(x.min()) < 0:
            raise ConfigError(f"data.path: token id {int(x.min())} in {self.data.path} is negative")
        if self.vocab_limit is not None and int(x.max()) >= self.vocab_limit:
            raise ConfigError(f"data.path: token id {int(x.max())} in {self.data.path} is not below the model's "
                              f"vocabulary size {self.vocab_limit} (data.token_dtype {self.data.token_dtype}?)")
        return x
