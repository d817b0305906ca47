"""Reference models used by pagemem's demo, tracer, benchmarks and tests."""

from pagemem.models.gpt import GPT, GPTConfig, gpt_config, init_module

__all__ = ["GPT", "GPTConfig", "gpt_config", "init_module"]
