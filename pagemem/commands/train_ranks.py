"""``pagemem train`` under torchrun: its ranks, their process group, what rank 0 decides for all.

[Note: pagemem train under torchrun]
``torchrun --nproc-per-node N -m pagemem train ...`` starts N processes with torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). With
more than one rank ``pagemem train`` initialises the default process group before it makes the
engine (gloo; NCCL when the gpu tier is CUDA, on device ``LOCAL_RANK``, which is then the store's
``cuda_device``) and destroys it when it ends, failed or not; the engine is data parallel over it
([Note: data parallel over the process group]). Rank 0 decides the run directory and tells the
others (one broadcast, its error raised on every rank); it alone writes the directory's files and
prints; a checkpoint is ``engine.save`` on every rank (collective). ``data.batch`` is per rank:
each rank trains on its slice of the step's combined batch (``BranchingTask.batch_at``). After
each step the ranks exchange their loss, step time and bytes sent (:class:`StepExchange`, one
small all-reduce every rank issues in the same place): the metrics' loss is the mean over ranks
(the combined batch's), ``tokens_per_s`` the group's, and log steps name each rank's.

A restarted attempt (``TORCHELASTIC_RESTART_COUNT`` > 0, ``torchrun --max-restarts``) given no
``--resume`` resumes the run the first attempt made (:func:`restart_target`). Without torchrun's
environment nothing here runs: one process, as before.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch

from pagemem.commands.run_dir import RunDir
from pagemem.engine.config import EngineConfig
from pagemem.errors import ConfigError, RankFailed

T = TypeVar("T")
TORCHRUN_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
KILL_HOOK = "PAGEMEM_TEST_KILL_RANK_AT"
"""A test hook (``tests/test_cmd_train_ranks.py``): ``"RANK:STEP"`` makes rank RANK SIGKILL
itself as step STEP (counted from 1, as in the metrics) begins, on torchrun's first attempt only."""


@dataclass(frozen=True)
class Launch:
    """Where this process stands among the ranks torchrun started (one process: :data:`ONE`)."""

    rank: int
    local_rank: int
    world_size: int
    restart: int
    """torchrun's attempt: 0 first, then one more for each restart."""

    @property
    def data_parallel(self) -> bool:
        return self.world_size > 1

    @property
    def lead(self) -> bool:
        """Rank 0: the one that writes the run directory and prints."""
        return self.rank == 0


ONE = Launch(0, 0, 1, 0)


def launch_from_env(env: Mapping[str, str] = os.environ) -> Launch:
    """torchrun's environment read, or :data:`ONE` when it is not all there."""
    if any(k not in env for k in TORCHRUN_ENV):
        return ONE
    try:
        world, rank, local = int(env["WORLD_SIZE"]), int(env["RANK"]), int(env["LOCAL_RANK"])
        restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        raise ConfigError("torchrun: WORLD_SIZE, RANK, LOCAL_RANK and TORCHELASTIC_RESTART_COUNT must be "
                          "integers") from None
    if world < 1 or not 0 <= rank < world or local < 0 or restart < 0:
        raise ConfigError(f"torchrun: RANK {rank}, LOCAL_RANK {local} do not fit WORLD_SIZE {world}")
    return Launch(rank, local, world, restart)


def uses_cuda(plain: Mapping[str, Any]) -> bool:
    """Whether the store's gpu tier will be CUDA (as ``pagemem.tiers`` decides it)."""
    return torch.cuda.is_available() and plain.get("store", {}).get("gpu_backend", "auto") != "host"


@contextlib.contextmanager
def process_group(launch: Launch, plain: Mapping[str, Any]) -> Iterator[None]:
    """The default process group over torchrun's ranks while the body runs (nothing for one rank)."""
    if not launch.data_parallel:
        yield
        return
    import torch.distributed as dist

    cuda = uses_cuda(plain)
    if cuda:
        torch.cuda.set_device(launch.local_rank)
    timeout = plain.get("engine", {}).get("collective_timeout_s", EngineConfig.collective_timeout_s)
    try:
        seconds = float(timeout)
    except (TypeError, ValueError):
        seconds = EngineConfig.collective_timeout_s  # resolve() names the bad value
    # torchrun's agent keeps its store across restarts (the static rendezvous of --master-port): each
    # attempt's keys apart, or gloo's and NCCL's rendezvous read the dead attempt's addresses and hang.
    # TORCHELASTIC_RESTART_COUNT is the same on every rank of one node (each agent counts its own).
    store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=seconds)))
    attempt = dist.PrefixStore(f"pagemem/attempt-{launch.restart}/", store)
    dist.init_process_group("nccl" if cuda else "gloo", store=attempt, rank=rank, world_size=world,
                            timeout=timedelta(seconds=seconds))
    try:
        yield
    finally:
        dist.destroy_process_group()


def on_device(launch: Launch, plain: dict[str, Any]) -> dict[str, Any]:
    """``plain`` with the store's ``cuda_device`` set to ``LOCAL_RANK`` when torchrun's ranks train on CUDA."""
    if launch.data_parallel and uses_cuda(plain):
        plain = {**plain, "store": {**plain.get("store", {}), "cuda_device": launch.local_rank}}
    return plain


def agreed(launch: Launch, decide: Callable[[], T]) -> T:
    """Rank 0's ``decide()``, on every rank: its value, or its error raised on every rank
    (a ``ConfigError`` as it is, else ``RankFailed`` naming rank 0)."""
    if not launch.data_parallel:
        return decide()
    import torch.distributed as dist

    box: list[Any] = [None]
    error: BaseException | None = None
    if launch.lead:
        try:
            box[0] = ("ok", decide())
        except BaseException as exc:  # noqa: BLE001 - told to the other ranks, then raised here
            error = exc
            kind = "config" if isinstance(exc, ConfigError) else "failed"
            box[0] = (kind, f"{type(exc).__name__}: {exc}" if kind == "failed" else str(exc))
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    kind, value = box[0]
    if kind == "config":
        raise ConfigError(value)
    if kind == "failed":
        raise RankFailed(f"rank {launch.rank}: rank 0 could not start the run ({value})", (0,))
    return value


def restart_target(launch: Launch, runs: str, name: str | None) -> str | None:
    """On a torchrun restart given no ``--resume``: the run directory to resume, or None to start
    afresh. ``train.name`` given: that run when it has a checkpoint, else it is removed (what a
    first attempt that died before its first checkpoint left) and started again. No name: the
    newest run under ``train.runs`` with a checkpoint, as ``--resume auto`` picks it (give runs
    that may restart a name, so no other run can be picked)."""
    if launch.restart == 0:
        return None
    if name is not None:
        path = os.path.join(runs, name)
        if RunDir(path).has_checkpoint() and os.path.exists(os.path.join(path, "config.json")):
            return path
        shutil.rmtree(path, ignore_errors=True)
        return None
    try:
        return RunDir.newest(runs).path
    except ConfigError:
        return None


def die_if_asked(launch: Launch, step: int) -> None:
    """The test hook :data:`KILL_HOOK`, as step ``step`` (from 1) begins."""
    hook = os.environ.get(KILL_HOOK)
    if hook and launch.restart == 0 and hook == f"{launch.rank}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


class StepExchange:
    """Every rank's loss, step seconds and bytes sent for each step, on every rank: one
    all-reduce of a ``[world_size, 3]`` float64 tensor (each rank fills its row). One rank: its own."""

    def __init__(self, launch: Launch, device: torch.device) -> None:
        self.launch = launch
        self.device = device
        """Where the group's collectives take tensors (the engine's ``ranks.device``)."""

    def __call__(self, loss: float, seconds: float, sent_bytes: int) -> list[tuple[float, float, int]]:
        if not self.launch.data_parallel:
            return [(loss, seconds, sent_bytes)]
        import torch.distributed as dist

        rows = torch.zeros(self.launch.world_size, 3, dtype=torch.float64, device=self.device)
        rows[self.launch.rank] = torch.tensor([loss, seconds, float(sent_bytes)], dtype=torch.float64)
        try:
            dist.all_reduce(rows)
        except RuntimeError as exc:  # a peer died or timed out: the restart resumes from the last checkpoint
            first = (str(exc).strip().splitlines() or [""])[0]
            raise RankFailed(f"rank {self.launch.rank} of {self.launch.world_size}: exchanging the step's metrics "
                             f"failed ({type(exc).__name__}: {first})") from exc
        return [(float(a), float(b), int(c)) for a, b, c in rows.cpu().tolist()]


class RankTotals:
    """Each rank's steps, seconds and bytes sent, since the last log step and in all, as the
    metrics' and the summary's ``ranks``: ``{"rank", "tokens_per_s", "sent_bytes"}`` per rank."""

    def __init__(self, world_size: int, tokens: int) -> None:
        self.tokens = tokens
        """Tokens one rank trains on in a step."""
        self.since = [[0, 0.0, 0] for _ in range(world_size)]
        self.total = [[0, 0.0, 0] for _ in range(world_size)]

    def add(self, rows: list[tuple[float, float, int]]) -> None:
        """One step's rows, as :class:`StepExchange` gives them."""
        for table in (self.since, self.total):
            for acc, (_, seconds, sent) in zip(table, rows):
                acc[0] += 1
                acc[1] += seconds
                acc[2] += sent

    def interval(self) -> list[dict[str, Any]]:
        """Since the last call (a log step's ``ranks``)."""
        out = self._rows(self.since)
        self.since = [[0, 0.0, 0] for _ in self.since]
        return out

    def overall(self) -> list[dict[str, Any]]:
        """Over every step this process ran (the summary's ``ranks``)."""
        return self._rows(self.total)

    def _rows(self, table: list[list[Any]]) -> list[dict[str, Any]]:
        return [{"rank": r, "tokens_per_s": self.tokens * n / seconds if seconds > 0 else None, "sent_bytes": sent}
                for r, (n, seconds, sent) in enumerate(table)]
