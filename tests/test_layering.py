"""Data flows one way: tracer -> scheduler -> engine -> store -> tiers. Each layer imports only
the layers this table allows (besides the leaves every layer may use), checked on the source of
every module, including imports inside functions."""

from __future__ import annotations

import ast
import pathlib

import pytest

import pagemem

LEAVES = {"pagemem.config", "pagemem.errors", "pagemem.units", "pagemem.checks", "pagemem.models", "pagemem.plain",
          "pagemem.machine", "pagemem.ownership", "pagemem.process"}
ALLOWED = {
    "tiers": set(),
    "store": {"tiers"},
    "tracer": set(),
    "sched": {"tracer"},
    "engine": {"sched", "tracer", "store"},
    "integrations": {"engine", "sched", "tracer", "store", "tiers"},  # the top floor, beside the commands
}
EXCEPTIONS: dict[tuple[str, str], set[str]] = {}
"""(layer, file) -> layers that one file may import besides its layer's (none today: the commands,
which drive several layers, live on the top floor, ``pagemem/commands``, and so do the framework
integrations, ``pagemem/integrations``, which import no command)."""
ROOT = pathlib.Path(pagemem.__file__).parent


def imported_layers(layer: str) -> dict[str, set[str]]:
    """For each pagemem module a layer imports: the files that import it."""
    seen: dict[str, set[str]] = {}
    for path in (ROOT / layer).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name == "pagemem" or name.startswith("pagemem."):
                    seen.setdefault(name, set()).add(path.name)
    return seen


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) < 2:
        return "pagemem"
    if ".".join(parts[:2]) in LEAVES:
        return "leaf"
    return parts[1]


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_what_the_flow_allows(layer):
    if not (ROOT / layer).is_dir():
        pytest.skip(f"pagemem/{layer} does not exist yet")
    bad = {}
    for module, files in imported_layers(layer).items():
        for f in files:
            if layer_of(module) not in ALLOWED[layer] | {"leaf", layer} | EXCEPTIONS.get((layer, f), set()):
                bad.setdefault(module, set()).add(f)
    assert not bad, f"pagemem.{layer} imports {bad}; allowed: {sorted(ALLOWED[layer])} and the leaves"


def test_leaves_import_no_layer():
    for leaf in LEAVES:
        path = ROOT / (leaf.split(".")[1] + ".py")
        if not path.exists():
            path = ROOT / leaf.split(".")[1] / "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pagemem."):
                assert layer_of(node.module) == "leaf" or node.module.startswith(leaf), (leaf, node.module)


def test_the_checker_sees_a_planted_violation(tmp_path, monkeypatch):
    """The check can fail: a store module importing the scheduler is caught."""
    fake = tmp_path / "store"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from pagemem.sched import plan\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
    assert "pagemem.sched" in imported_layers("store")
    assert layer_of("pagemem.sched") not in ALLOWED["store"]
