"""pagemem's commands, at the top floor: each a module with ``configure(parser)`` and
``run(args) -> int``, a thin function over the layers. ``pagemem.cli`` runs them."""

COMMANDS: list[tuple[str, str, str]] = [
    ("train", "pagemem.commands.train", "train a model through the engine from one config into a run directory"),
    ("export", "pagemem.commands.export", "write a pagemem train run's weights as safetensors / a Hugging Face model directory"),
    ("demo", "pagemem.commands.demo", "store a model-sized set of tensors across the tiers, move them, verify every byte"),
    ("trace", "pagemem.commands.trace", "trace one training iteration of the GPT (or synthesise it) and write trace JSON files"),
    ("plan", "pagemem.commands.plan", "plan one training iteration: the task queue, its validated peak memory"),
    ("simulate", "pagemem.commands.simulate", "plan and simulate one training iteration on a hardware profile"),
    ("profile", "pagemem.commands.profile", "measure this machine into a hardware profile for the simulator"),
    ("doctor", "pagemem.commands.doctor", "what this machine offers (GPU, PCIe, pinned memory, AIO, O_DIRECT) and what pagemem will use"),
    ("io-tune", "pagemem.commands.io_tune", "sweep page size, queue depth and I/O engine on a directory; write the best as a [store] config"),
    ("bench", "pagemem.commands.bench", "run the benchmarks; each headline figure beside its anchor from the same run"),
]
"""(name, module, one-line help). Add a command by adding a row."""
