"""Training frameworks on top of the engine: the top floor, beside ``pagemem.commands``.

- ``pagemem.integrations.hf``: ``PagememTrainer``, a Hugging Face ``transformers.Trainer`` whose
  model trains through an :class:`pagemem.Engine` (``pip install pagemem[hf]``).
- ``pagemem.integrations.lightning``: ``PagememStrategy`` and ``PagememPrecision``, registered as
  ``lightning.pytorch.Trainer(strategy="pagemem")`` once imported (``pip install pagemem[lightning]``).

Each framework keeps its own knobs (gradient clipping, accumulation, precision, schedulers,
checkpoint cadence); ``framework.py`` turns them into the engine's, once, for both. Neither
module is imported here: each needs its framework installed.
"""
