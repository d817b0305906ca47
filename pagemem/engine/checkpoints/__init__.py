"""Checkpoints: save and load (``checkpoint.py``, through a narrow handle, ``Checkpointed``), the
checksummed manifest (``manifest.py``), durable writes (``ckpt_io.py``), buffers and the model
snapshot a refused load restores (``ckpt_state.py``)."""
