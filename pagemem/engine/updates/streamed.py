"""The update streamed through the cpu ([Note: homes on nvme] in ``units/homes.py``): where
optimizer states or gradient sums live on nvme, ``step()`` takes the parameters a batch at a
time (at most half the cpu room each, the other half the last batch's write-back), their states
and sums moved to the cpu, updated, written back behind the next batch; the loss scale's
verdict and the clipping coefficient are read from the sums first, one parameter at a time. A
part of ``Updater`` (a mixin over its fields)."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Iterator

from pagemem.engine.updates.adam import total_sumsq, wait_all
from pagemem.engine.updates.state_pieces import norm_of_pieces
from pagemem.errors import OutOfMemory, StepIOError, TierIOError

if TYPE_CHECKING:
    from pagemem.engine.updates.update import UnfinishedUpdate


@contextlib.contextmanager
def retryable(what: str, where: str, u: "UnfinishedUpdate") -> Iterator[None]:
    """A ``TierIOError`` inside becomes a ``StepIOError`` saying what failed, how far the update
    got and that ``step()`` again retries ([Note: a step is a transaction]): the update is left
    unfinished, its gradients kept."""
    try:
        yield
    except TierIOError as exc:
        notes = "".join(f"; {n}" for n in getattr(exc, "__notes__", ()))
        done = ("nothing was updated" if not u.done else
                f"{len(u.done)} of {len(u.params)} parameters were updated")
        raise StepIOError(f"step: {what} failed ({exc}{notes}); {done} and the gradients are kept "
                          f"({where}): call step() again to retry once the disk works, or load a checkpoint",
                          exc.errno) from exc


class StreamedUpdate:
    """``Updater``'s streamed update (see the module docs)."""

    def _bring(self, disk: list, u: "UnfinishedUpdate") -> None:
        """[Note: optimizer states on nvme] Move states and gradient sums home to the cpu for the
        update (the executor may have copied states there during backward, where the plan says:
        moving onto those replicas reads nothing); the stale nvme copies are dropped so that the
        update's writes stay in memory. The last batch's write-back goes on behind this read
        while the cpu has room for both, else it is waited for first."""
        grads = {id(t) for li in {self.bank.layer_of[i] for i in u.params} for t in self.bank.layers[li].grad
                 if t is not None}
        kinds = sorted({"gradient sums" if id(t) in grads else "optimizer states" for t in disk}, reverse=True)
        with retryable(f"reading the {' and '.join(kinds)} from nvme for the update",
                        "the pages that failed stay on nvme, unchanged, and are read again", u):
            try:
                handle = self.store.move(disk, "cpu")
            except OutOfMemory:
                self.flush()  # its pages go back to nvme first, and copies staged ahead give way
                self.bank.drop_cpu_copies()
                try:
                    handle = self.store.move(disk, "cpu")
                except OutOfMemory as exc:  # one parameter's states and sums do not fit the cpu at all
                    pb = exc.page_bytes
                    least = self.store.tier("cpu").capacity * pb + (exc.requested_pages - exc.free_pages) * pb
                    raise OutOfMemory("cpu", exc.requested_pages, exc.free_pages, pb,
                                      "cpu_bytes: the update brings these parameters' optimizer states and gradient "
                                      "sums from nvme at once (a parameter unfrozen after the engine was made counts "
                                      "only from then on); nothing was updated", least_bytes=least,
                                      least_is_bound=True) from None
            handle.wait()
            self.store.release(disk, "nvme").wait()

    def _batches(self, params: list[int]) -> list[list[int]]:
        """``params`` in batches whose states and gradient sums on nvme take at most half the cpu
        room (the other half takes the last batch's write-back meanwhile), in unit order, one
        parameter at least; those with nothing to read from nvme go in the first."""
        room = self.store.tier("cpu").free_pages // 2
        staged = [i for i in params if self.bank.on_disk([i])
                  and all("cpu" in self.store.tiers_of(t) for t in self.bank.on_disk([i]))]
        # in memory, or copied to the cpu during backward (the plan's move_to_cpu optim): moving
        # their home there takes no new page, so they go first, whatever the room (dropping those
        # copies to make room for others read them twice: 3x the disk traffic, measured)
        batches: list[list[int]] = [[i for i in params if not self.bank.on_disk([i])] + staged]
        taken = set(staged)
        disk: list = []  # the last batch's tensors on nvme (neighbours share pages: counted once)
        for i in sorted((i for i in params if self.bank.on_disk([i]) and i not in taken),
                        key=lambda i: (self.bank.layer_of[i], i)):
            mine = self.bank.on_disk([i])
            if disk and self.store.page_count(disk + mine) > room:
                batches.append([])
                disk = []
            batches[-1].append(i)
            disk += mine
        return [b for b in batches if b]

    def _check_streamed(self, u: "UnfinishedUpdate", params: list[int]) -> bool:
        """The loss scale's verdict and the clipping coefficient from gradient sums read one
        parameter at a time (those on nvme through a host copy), before any update: the same
        values ``_update_batch``'s check takes from them in memory."""
        need_scale, need_clip = u.scale is not None, self.config.max_grad_norm is not None
        if not (need_scale or need_clip):
            return True
        spread = self.sums.spread
        if spread is not None:  # [Note: sharded gradient sums]: this rank's shares, reduced over the ranks
            if need_scale and not spread.all_finite(params):
                self._skip()
                return False
            if need_clip:
                u.coef = self._clip_coefficient(self.sums.norms(params), u.scale)
            return True
        self.bank.grads_landed(params)
        parts, norms = [], []
        for i in params:
            with self.bank.grad_pieces(i, write=False) as pieces:
                grads = [v for _, v in pieces]
                if need_scale:
                    parts += wait_all([self.adam.sumsq(g) for g in grads])
                if need_clip:
                    norms.append(norm_of_pieces(grads))
        if need_scale and not math.isfinite(total_sumsq(parts)):
            self._skip()
            return False
        if need_clip:
            u.coef = self._clip_coefficient(norms, u.scale)
        return True
