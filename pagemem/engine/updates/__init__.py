"""Gradient sums to new weights: the step as a transaction (``update.py``), fused AdamW on CPU
workers (``adam.py``, ``adam_threads.py``) over page views (``state_pieces.py``), loss scaling
(``loss_scale.py``), the lock-free updater (``lockfree.py``), parameter groups (``groups.py``)
and the optimizer's state dict over the pages (``optimizer_states.py``)."""
