import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.units import format_bytes, parse_size


@pytest.mark.parametrize("text,value", [
    ("4MiB", 4 << 20), ("4 MiB", 4 << 20), ("1GiB", 1 << 30), ("512KiB", 512 << 10),
    ("2GB", 2 * 10**9), ("1.5GiB", 3 << 29), ("4096", 4096), ("3tib", 3 << 40),
])
def test_parse_size_units(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["4 mebibytes", "", "-1", "1.3B", "MiB", True, 1.5, None, -5])
def test_parse_size_rejects_with_field_name(bad):
    with pytest.raises(pagemem.ConfigError, match="gpu_bytes"):
        parse_size(bad, "gpu_bytes")


@given(st.integers(min_value=0, max_value=2**60))
def test_parse_size_int_identity(n):
    assert parse_size(n) == n
    assert parse_size(str(n)) == n


def test_format_bytes():
    assert format_bytes(4 << 20) == "4.0 MiB"
    assert format_bytes(100) == "100 B"
    assert format_bytes(3 << 40) == "3.0 TiB"


def test_config_normalises_sizes(tmp_path):
    cfg = pagemem.StoreConfig(page_bytes="4MiB", gpu_bytes="1GiB", cpu_bytes="2GiB",
                              nvme_bytes="8GiB", nvme_path=str(tmp_path))
    assert (cfg.page_bytes, cfg.gpu_bytes, cfg.cpu_bytes, cfg.nvme_bytes) == (4 << 20, 1 << 30, 2 << 30, 8 << 30)
    assert cfg.pages("gpu") == 256 and cfg.pages("nvme") == 2048
    assert cfg.nvme_paths == (str(tmp_path),)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.page_bytes = 8192  # type: ignore[misc]


def test_capacity_rounds_down_to_whole_pages():
    cfg = pagemem.StoreConfig(page_bytes=8192, cpu_bytes=8192 * 3 + 100)
    assert cfg.pages("cpu") == 3


@pytest.mark.parametrize("field,value,match", [
    ("page_bytes", 1000, r"page_bytes: must be a positive multiple of 4096"),
    ("page_bytes", 0, r"page_bytes"),
    ("page_bytes", "3KiB", r"page_bytes"),
    ("io_depth", 0, r"io_depth: must be an integer in \[1, 1024\]"),
    ("io_depth", 5000, r"io_depth"),
    ("io_engine", "uring", r"io_engine: must be one of 'auto', 'aio', 'threads'"),
    ("gpu_backend", "rocm", r"gpu_backend"),
    ("staging_pages", 0, r"staging_pages: must be an integer in \[1, 4096\]"),
    ("copy_threads", -1, r"copy_threads: must be an integer in \[0, 64\]"),
    ("checksums", "yes", r"checksums: must be True or False"),
    ("cpu_bytes", "lots", r"cpu_bytes"),
])
def test_bad_config_names_field_and_range(field, value, match):
    with pytest.raises(pagemem.ConfigError, match=match):
        pagemem.StoreConfig(**{field: value})


def test_config_error_is_value_error():
    with pytest.raises(ValueError):
        pagemem.StoreConfig(page_bytes=1)


def test_nvme_needs_an_existing_directory(tmp_path):
    with pytest.raises(pagemem.ConfigError, match="nvme_path: required"):
        pagemem.StoreConfig(nvme_bytes="1MiB")
    with pytest.raises(pagemem.ConfigError, match="not an existing directory"):
        pagemem.StoreConfig(nvme_bytes="1MiB", nvme_path=str(tmp_path / "missing"))
    with pytest.raises(pagemem.ConfigError, match="listed twice"):
        pagemem.StoreConfig(nvme_bytes="1MiB", nvme_path=[str(tmp_path), str(tmp_path)])


def test_several_nvme_directories(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(); b.mkdir()
    cfg = pagemem.StoreConfig(nvme_bytes="1MiB", nvme_path=[a, b])
    assert cfg.nvme_paths == (str(a), str(b))


def test_cuda_backend_without_cuda_is_a_config_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(pagemem.ConfigError, match="gpu_backend: 'cuda' needs a CUDA device"):
        pagemem.PageStore(pagemem.StoreConfig(gpu_backend="cuda", gpu_bytes="1MiB"))


# ---------------------------------------------------------------- a refusal names what the user set

@pytest.mark.parametrize("value", ["1PiB", 1 << 50, "2GiB", (1 << 30) + 4096])
def test_an_absurd_page_size_is_refused_at_construction_naming_page_bytes(value):
    with pytest.raises(pagemem.ConfigError, match=r"^page_bytes: must be a positive multiple of 4096 bytes, "
                                                  r"at most 1073741824 \(1.0 GiB\), got "):
        pagemem.StoreConfig(page_bytes=value)
    assert pagemem.StoreConfig(page_bytes="1GiB").page_bytes == 1 << 30


def test_staging_that_does_not_fit_names_both_fields_and_which_was_left_as_it_was(monkeypatch):
    from pagemem.tiers import budgets

    monkeypatch.setattr(budgets, "host_memory_available", lambda: 64 << 20)
    with pytest.raises(pagemem.ConfigError, match=r"^staging_pages, page_bytes: staging_pages=8 \(the default\) "
                                                  r"pages of page_bytes=1073741824 \(1.0 GiB\) take .* lower page_bytes "
                                                  r"\(from 4096 to 1073741824\) or staging_pages \(from 1 to 4096\)"):
        budgets.check_budgets(pagemem.StoreConfig(page_bytes="1GiB"), False)
    with pytest.raises(pagemem.ConfigError, match=r"^staging_pages, page_bytes: staging_pages=4096 pages of "
                                                  r"page_bytes=4194304 \(the default\)"):
        budgets.check_budgets(pagemem.StoreConfig(staging_pages=4096), False)


_UNITS = ["", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB", "KB", "GB"]
_SIZES = st.one_of(st.integers(-(2 ** 62), 2 ** 62), st.integers(0, 1 << 40).map(lambda n: n * 4096),
                   st.builds(lambda n, u: f"{n}{u}", st.integers(0, 4096), st.sampled_from(_UNITS)))
_COUNTS = st.one_of(st.integers(-4, 16), st.integers(-(2 ** 40), 2 ** 40))
_STORE = {"page_bytes": _SIZES, "gpu_bytes": _SIZES, "cpu_bytes": _SIZES, "nvme_bytes": _SIZES,
          "nvme_bandwidth": _SIZES, "staging_pages": _COUNTS, "io_depth": _COUNTS, "copy_threads": _COUNTS,
          "cuda_device": _COUNTS}
_ENGINE = {"accumulation_steps": _COUNTS, "collective_timeout_s": _COUNTS, "adam_threads": _COUNTS,
           "max_staleness": _COUNTS, "lock_free": st.booleans(),
           "optimizer_tier": st.sampled_from(["gpu", "cpu", "nvme"])}


def _some(fields: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional=fields)


def _names_what_was_set(err: Exception, passed: set[str]) -> None:
    """The fields before the message's first colon: each one the user passed, or stated as left
    at its default."""
    import re

    text = str(err)
    lead = [n.removeprefix("store.") for n in re.split(r"[ ,+]+", text.split(":", 1)[0]) if n]
    assert lead, text
    for name in lead:
        assert name in passed or re.search(rf"\b{name}=[^;]*?\(the default\)", text), (name, passed, text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(store=_some(_STORE), engine=_some(_ENGINE), with_path=st.booleans())
def test_every_refusal_of_random_sizes_names_a_field_the_user_set(tmp_path, store, engine, with_path):
    from pagemem.tiers import budgets

    store = dict(store, **({"nvme_path": str(tmp_path)} if with_path else {}))
    passed = set(store) | set(engine)
    try:
        cfg = pagemem.StoreConfig(**store)
        budgets.check_budgets(cfg, False)  # what PageStore checks first; it allocates nothing
        pagemem.EngineConfig(store=cfg, **engine)
    except pagemem.ConfigError as err:
        _names_what_was_set(err, passed)
