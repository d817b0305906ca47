import dataclasses

import pytest
from hypothesis import given
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
