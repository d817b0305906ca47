"""Loss scaling as ``torch.amp.GradScaler`` schedules it."""

from __future__ import annotations


class LossScaler:
    """``torch.amp.GradScaler``'s schedule: start at 2**16, double after 2000 good steps, halve on
    an overflow; a static scale never changes; None: no scaling."""

    def __init__(self, scale: str | float | None) -> None:
        self.dynamic = scale == "dynamic"
        self.scale: float | None = 65536.0 if self.dynamic else scale  # type: ignore[assignment]
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            self.scale *= 0.5  # type: ignore[operator]
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == 2000:
                self.scale *= 2.0  # type: ignore[operator]
                self.good_steps = 0
