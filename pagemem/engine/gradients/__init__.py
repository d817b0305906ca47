"""Gradients between autograd and the update: the hand-off hook and the destination chosen once
(``gradients.py``), each parameter's gradient state (``grad_ledger.py``), units whose gradients
are final (``handoff.py``), ``p.grad`` handles (``grads.py``) and copies to host pages off the
compute stream (``grad_copies.py``)."""

_OLD_NAMES = frozenset({"GradDestination", "Gradients", "LockFreeDestination", "SyncDestination"})


def __getattr__(name: str) -> object:
    """``pagemem.engine.gradients`` was the module ``gradients.py`` before the rooms: its names
    stay reachable here (looked up when asked for: the room's modules import each other)."""
    if name in _OLD_NAMES:
        from pagemem.engine.gradients import gradients

        return getattr(gradients, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
