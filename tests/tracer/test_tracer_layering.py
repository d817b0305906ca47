"""The tracer sits at the top of the layering: it imports no lower pagemem layer."""

from __future__ import annotations

import ast
import pathlib

import pagemem.tracer

ALLOWED = {"pagemem.errors", "pagemem.units", "pagemem.models", "pagemem.models.gpt"}


def test_tracer_imports_only_leaf_modules():
    root = pathlib.Path(pagemem.tracer.__file__).parent
    seen = set()
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("pagemem") and not name.startswith("pagemem.tracer"):
                    seen.add(name)
    assert seen and seen <= ALLOWED, seen - ALLOWED


def test_repr_is_short():
    tr = pagemem.tracer.synthetic_transformer(layers=2, hidden=32, heads=2, seq=8, batch=1, vocab=64)
    assert len(repr(tr)) < 200 and "fingerprint" in repr(tr)
