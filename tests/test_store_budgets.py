"""Every tier's budget is checked against the machine before anything is allocated
([Note: budgets checked up front], ``pagemem/tiers/budgets.py``): a ConfigError names the field,
the request and what is available, and nothing (arena, page file, page table) was made."""

from __future__ import annotations

import os

import pytest

import pagemem
from pagemem.tiers import base, budgets

PAGE = 64 * 1024


def config(tmp_path=None, **kw) -> pagemem.StoreConfig:
    kw.setdefault("page_bytes", PAGE)
    kw.setdefault("gpu_backend", "host")
    if tmp_path is not None:
        kw.setdefault("nvme_path", str(tmp_path))
    return pagemem.StoreConfig(**kw)


@pytest.fixture
def no_page_tables(monkeypatch):
    """Counts the page tables (free lists, one byte per slot) made: a refused store makes none."""
    made = []
    real = base.SlotFreeList

    def counting(capacity):
        made.append(capacity)
        return real(capacity)

    monkeypatch.setattr(base, "SlotFreeList", counting)
    return made


@pytest.mark.parametrize("field", ["cpu_bytes", "gpu_bytes"])
def test_a_memory_tier_larger_than_host_memory_is_a_config_error_naming_it(field, no_page_tables):
    with pytest.raises(pagemem.ConfigError, match=rf"^{field}: requested 1024.0 TiB .* of host memory .* "
                                                  r"GiB \(\d+ bytes\) is available"):
        pagemem.PageStore(config(**{field: "1PiB"}))
    assert no_page_tables == []


def test_tiers_that_fit_alone_but_not_together_are_named_together(monkeypatch, no_page_tables):
    monkeypatch.setattr(budgets, "host_memory_available", lambda: 20 * PAGE)
    with pytest.raises(pagemem.ConfigError, match=r"^gpu_bytes \+ cpu_bytes \+ staging_pages: together .* "
                                                  r"\(1310720 bytes\) is available"):
        pagemem.PageStore(config(gpu_bytes=8 * PAGE, cpu_bytes=8 * PAGE, staging_pages=8))
    assert no_page_tables == []
    pagemem.PageStore(config(gpu_bytes=8 * PAGE, cpu_bytes=8 * PAGE, staging_pages=2)).close()  # it fits


def test_an_oversized_nvme_tier_is_refused_before_any_page_table_or_file(tmp_path, no_page_tables):
    with pytest.raises(pagemem.ConfigError, match=r"^nvme_bytes: requested 1024.0 TiB .* in '.*' need .* "
                                                  r"that filesystem has .* free"):
        pagemem.PageStore(config(tmp_path, nvme_bytes="1PiB", cpu_bytes=4 * PAGE))
    assert no_page_tables == []  # not 2**34 bytes of in-use flags first
    assert list(tmp_path.iterdir()) == []


def test_directories_on_one_filesystem_add_up(tmp_path):
    """Each of two page files fits the disk's free space, both together do not."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with pytest.raises(pagemem.ConfigError, match=r"^nvme_bytes: .* in '.*a', '.*b' need"):
        pagemem.PageStore(config(nvme_path=[str(a), str(b)], nvme_bytes=free // 4 * 6))
    assert list(a.iterdir()) == list(b.iterdir()) == []


def test_the_nvme_page_table_counts_against_host_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(budgets, "host_memory_available", lambda: 1 << 20)
    big = config(tmp_path, page_bytes=4096, nvme_bytes=512 << 20, staging_pages=1)  # 131072 slots
    with pytest.raises(pagemem.ConfigError, match=r"^nvme_bytes: requested 512.0 MiB .* takes 1.2 MiB .* "
                                                  r"for the nvme page table, but 1.0 MiB \(1048576 bytes\)"):
        budgets.check_budgets(big, False)
    budgets.check_budgets(config(tmp_path, page_bytes=4096, nvme_bytes=64 << 20, staging_pages=1), False)  # fits


def test_an_unwritable_nvme_path_is_a_config_error_naming_it(tmp_path):
    if os.geteuid() == 0:  # root writes through permission bits; sysfs takes no files from anyone
        directory = "/sys"
    else:
        directory = str(tmp_path / "ro")
        os.mkdir(directory, 0o500)
    if budgets.unwritable(directory) is None:
        pytest.skip(f"{directory} takes files here")
    with pytest.raises(pagemem.ConfigError, match=rf"^nvme_path: page files cannot be made in '{directory}': "
                                                  r"a file cannot be created there: E[A-Z]+ \("):
        pagemem.PageStore(config(nvme_path=directory, nvme_bytes=4 * PAGE))


def test_a_missing_nvme_path_is_a_config_error_naming_it(tmp_path):
    gone = tmp_path / "gone"
    gone.mkdir()
    cfg = config(nvme_path=str(gone), nvme_bytes=4 * PAGE)  # existed when the config was made
    gone.rmdir()
    with pytest.raises(pagemem.ConfigError, match=rf"^nvme_path: .* in '{gone}': it is not an existing directory"):
        pagemem.PageStore(cfg)


def test_a_cuda_arena_larger_than_the_device_is_named(monkeypatch):
    """Without a GPU here: the device's free memory as the check reads it is stood in for."""
    monkeypatch.setattr(budgets, "device_memory_free", lambda device, wanted: (1 << 30, 80 << 30))
    with pytest.raises(pagemem.ConfigError, match=r"^gpu_bytes: 2.0 GiB \(2147483648 bytes\) requested on "
                                                  r"cuda:0, but it has 1.0 GiB \(1073741824 bytes\) free of 80.0 GiB"):
        budgets.check_budgets(config(gpu_bytes="2GiB", gpu_backend="auto"), use_cuda=True)
    budgets.check_budgets(config(gpu_bytes="1GiB", gpu_backend="auto"), use_cuda=True)  # fits exactly
