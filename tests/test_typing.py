"""pagemem ships its inline types (PEP 561): ``pagemem/py.typed`` is in the package data, and the
public API (``pagemem.__all__``) is annotated, so a type checker sees it."""

from __future__ import annotations

import inspect
import os
import tomllib

import pagemem

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_py_typed_is_package_data():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    assert "py.typed" in setuptools["package-data"]["pagemem"]
    assert os.path.isfile(os.path.join(os.path.dirname(pagemem.__file__), "py.typed"))


def unannotated(qualname: str, fn) -> list[str]:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature
        return []
    out = [f"{qualname}({name})" for name, p in sig.parameters.items()
           if name not in ("self", "cls") and p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty and not qualname.endswith(".__init__"):
        out.append(f"{qualname} -> ?")
    return out


PUBLIC_DUNDERS = {"__init__", "__call__", "__enter__", "__exit__", "__getitem__", "__len__", "__iter__"}


def public_functions(obj) -> list[tuple[str, object]]:
    """``obj`` itself if a function; for a class, its public methods and properties, those
    inherited from pagemem's own classes included."""
    if not inspect.isclass(obj):
        return [(obj.__name__, obj)] if callable(obj) else []
    out, seen = [], set()
    for klass in obj.__mro__:
        if not klass.__module__.startswith("pagemem"):
            continue
        for attr, member in vars(klass).items():
            if attr in seen or (attr.startswith("_") and attr not in PUBLIC_DUNDERS):
                continue
            seen.add(attr)
            if isinstance(member, property):
                member = member.fget
            elif isinstance(member, (staticmethod, classmethod)):
                member = member.__func__
            if inspect.isfunction(member):
                out.append((f"{obj.__name__}.{attr}", member))
    return out


def test_the_public_api_is_annotated():
    missing = [m for name in pagemem.__all__ for q, fn in public_functions(getattr(pagemem, name))
               for m in unannotated(q, fn)]
    assert not missing, f"public names without annotations: {missing}"


def test_the_check_sees_a_missing_annotation():
    class Planted:
        def ok(self, x: int) -> int:
            return x

        def bad(self, x):
            return x

    Planted.__module__ = "pagemem.planted"
    missing = [m for q, fn in public_functions(Planted) for m in unannotated(q, fn)]
    assert missing == ["Planted.bad(x)", "Planted.bad -> ?"]
