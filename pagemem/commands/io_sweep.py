"""The measurements behind ``pagemem io-tune`` and the rules that pick from them.

- Disk: for each I/O engine, page size and queue depth, ``PageStore`` moves of ``total_bytes``
  between the cpu and nvme tiers through pagemem's nvme tier, checksums on and O_DIRECT where it
  works, as in use (:func:`pagemem.commands.measure.nvme`: one untimed pass lays the file out,
  then the median of ``repeats`` timed writes and reads). A depth above the pages that fit in
  ``total_bytes`` is skipped: it would measure that many pages in flight again.
- :func:`pick_best`: the setting with the highest ``min(read, write)``; among those within 5% of
  it (noise), the smallest page, then the smallest depth, then the engine listed first. Smaller
  pages waste less memory to rounding; a lower depth costs less host time.
- Host <-> GPU copies (CUDA only): pinned ``copy_`` in both directions over transfer sizes
  (:func:`pagemem.commands.measure.cuda_copy`), and :func:`plateau`: as ANGEL-PTM picks its page
  size (section 4.1), the smallest transfer whose bandwidth (the lower of h2d and d2h) is within
  5% of the best: past it, larger pages buy no bandwidth and cost memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pagemem.commands import measure, probes

TOLERANCE = 0.05
"""Bandwidths within this fraction of the best count as equal (noise; the plateau)."""
ENGINES = ("aio", "threads")
COPY_SIZES = tuple((64 << 10) << i for i in range(11))
"""Host <-> GPU transfer sizes swept: 64 KiB to 64 MiB."""
COPY_BYTES_PER_RUN = 64 << 20
"""Bytes each timed copy run moves: small transfers are repeated up to it."""


@dataclass(frozen=True)
class Measurement:
    """One disk setting and its bandwidths (bytes per second)."""

    page_bytes: int
    io_depth: int
    io_engine: str
    read_bytes_per_s: float
    write_bytes_per_s: float
    direct_io: bool

    @property
    def score(self) -> float:
        return min(self.read_bytes_per_s, self.write_bytes_per_s)


@dataclass(frozen=True)
class Skipped:
    """A setting (or a whole engine: ``page_bytes`` and ``io_depth`` None) not measured, and why."""

    io_engine: str
    page_bytes: int | None
    io_depth: int | None
    reason: str


def cuda_available() -> bool:
    return torch.cuda.is_available()


def engine_unavailable(engine: str, directory: str) -> str | None:
    """Why ``engine`` cannot run on page files in ``directory``, or None."""
    if engine != "aio":
        return None
    why = probes.aio_unavailable()
    if why is not None:
        return why
    direct = probes.o_direct_fails(directory)
    if direct is not None:
        return f"it needs O_DIRECT (without it Linux runs AIO synchronously), which fails here: {direct}"
    return None


def sweep_disk(path: str, page_sizes: Sequence[int], depths: Sequence[int], engines: Sequence[str],
               total_bytes: int, repeats: int,
               log: Callable[[Measurement | Skipped], None] = lambda _: None,
               ) -> tuple[list[Measurement], list[Skipped]]:
    """Every (engine, page size, depth) on page files in ``path``, ``total_bytes`` per pass
    (each page size must fit in it); ``log`` sees each result as it comes."""
    done: list[Measurement] = []
    skipped: list[Skipped] = []

    def note(item: Measurement | Skipped) -> None:
        (done if isinstance(item, Measurement) else skipped).append(item)  # type: ignore[arg-type]
        log(item)

    for engine in engines:
        why = engine_unavailable(engine, path)
        if why is not None:
            note(Skipped(engine, None, None, why))
            continue
        for page in page_sizes:
            pages = total_bytes // page
            for depth in depths:
                if depth > pages:
                    note(Skipped(engine, page, depth, f"only {pages} pages of {size_text(page)} fit in total_bytes "
                                 f"{size_text(total_bytes)}, so depth {depth} would measure depth {pages} again "
                                 f"(total_bytes {size_text(page * depth)} measures it)"))
                    continue
                read, write, info = measure.nvme(path, pages * page, repeats, depth, page_bytes=page, engine=engine)
                note(Measurement(info["page_bytes"], info["io_depth"], info["io_engine"], read, write,
                                 bool(info["direct_io"])))  # as the tier ran it
    return done, skipped


def pick_best(measurements: Sequence[Measurement], tolerance: float = TOLERANCE,
              engines: Sequence[str] = ENGINES) -> Measurement:
    """The best setting: highest ``min(read, write)``; among those within ``tolerance`` of it the
    smallest page, then the smallest depth, then the engine first in ``engines``."""
    if not measurements:
        raise ValueError("no measurements to pick from")
    top = max(m.score for m in measurements)
    near = [m for m in measurements if m.score >= (1 - tolerance) * top]
    rank = {e: i for i, e in enumerate(engines)}
    return min(near, key=lambda m: (m.page_bytes, m.io_depth, rank.get(m.io_engine, len(rank))))


def plateau(sizes: Sequence[int], rates: Sequence[float], tolerance: float = TOLERANCE) -> int:
    """The smallest size whose rate is within ``tolerance`` of the highest rate (ANGEL-PTM's page
    size: where the link's bandwidth levels off)."""
    if len(sizes) != len(rates) or not sizes:
        raise ValueError(f"plateau: need as many rates as sizes, at least one ({len(sizes)} and {len(rates)})")
    top = max(rates)
    return min(s for s, r in zip(sizes, rates) if r >= (1 - tolerance) * top)


@dataclass(frozen=True)
class CopySweep:
    """Host <-> GPU bandwidth (bytes per second) over transfer sizes."""

    sizes: tuple[int, ...]
    h2d: tuple[float, ...]
    d2h: tuple[float, ...]

    @property
    def rates(self) -> tuple[float, ...]:
        """The lower direction at each size: a page moves both ways."""
        return tuple(min(a, b) for a, b in zip(self.h2d, self.d2h))

    def page_bytes(self, tolerance: float = TOLERANCE) -> int:
        return plateau(self.sizes, self.rates, tolerance)


def sweep_copies(sizes: Sequence[int], repeats: int) -> CopySweep:
    """Pinned host <-> current CUDA device copies at each size (needs CUDA); each timed run moves
    about :data:`COPY_BYTES_PER_RUN`."""
    h2d, d2h = [], []
    for size in sizes:
        a, b = measure.cuda_copy(size, repeats, count=max(1, COPY_BYTES_PER_RUN // size))
        h2d.append(a)
        d2h.append(b)
    return CopySweep(tuple(sizes), tuple(h2d), tuple(d2h))


def plot_copies(sweep: CopySweep, chosen: int, link_bytes_per_s: float | None, path: str | os.PathLike,
                title: str = "") -> str:
    """Bandwidth against transfer size, both directions, the plateau band and the chosen page
    size (and the link's theoretical bandwidth where known), as a PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    kib = [s / 1024 for s in sweep.sizes]
    ax.plot(kib, [r / 1e9 for r in sweep.h2d], "o-", label="host -> GPU")
    ax.plot(kib, [r / 1e9 for r in sweep.d2h], "s-", label="GPU -> host")
    top = max(sweep.rates) / 1e9
    ax.axhspan((1 - TOLERANCE) * top, top, color="#cfe8cf", label=f"plateau (within {TOLERANCE:.0%} of the best)")
    ax.axvline(chosen / 1024, color="#c0392b", lw=1.5, label=f"page_bytes = {size_text(chosen)}")
    if link_bytes_per_s:
        ax.axhline(link_bytes_per_s / 1e9, color="grey", ls="--", label="link, theoretical")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("transfer size (KiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(title or "pinned host <-> GPU copies")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return os.fspath(path)


def size_text(n: int) -> str:
    """``n`` bytes as the shortest exact size string (``"4MiB"``, ``"256KiB"``, ``"12288"``)."""
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)

