"""The README's configuration reference names every field a config file can set."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pagemem
from pagemem.commands.train_config import ModelSettings, TrainSettings
from pagemem.commands.train_data import DataSettings

ROOT = pathlib.Path(__file__).resolve().parent.parent


def reference() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Configuration reference")
    return text[start:text.index("\n## ", start + 1)]


def test_the_configuration_reference_names_every_field():
    ref = reference()
    sections = {"[store]": pagemem.StoreConfig, "[engine]": pagemem.EngineConfig, "[optimizer]": pagemem.AdamW,
                "[train]": TrainSettings, "[model]": ModelSettings, "[data]": DataSettings}
    for section, cls in sections.items():
        assert f"`{section}`" in ref, section
        for f in dataclasses.fields(cls):
            if f.init and f.name not in ("store", "optimizer"):
                assert re.search(rf"`{f.name}`", ref), f"README's configuration reference lacks {section} {f.name}"
