"""pagemem.plain: config dataclasses to and from plain values, one name per knob."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.plain import field_names, from_plain, parse_value, to_plain, with_overrides

STORE = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=1 << 24, cpu_bytes=1 << 24)


@settings(max_examples=60, deadline=None)
@given(lr=st.floats(1e-6, 1.0), beta=st.floats(0.0, 0.99), tier=st.sampled_from(["cpu", "gpu"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       lock_free=st.booleans(), staleness=st.one_of(st.none(), st.integers(0, 8)),
       correction=st.sampled_from(["predict", "none"]), io_depth=st.integers(1, 1024),
       nvme=st.one_of(st.none(), st.just("/tmp"), st.just(["/tmp", "/var/tmp"])))
def test_engine_config_round_trips_through_json(lr, beta, tier, dtype, lock_free, staleness, correction, io_depth,
                                                nvme):
    store = pagemem.StoreConfig(gpu_backend="host", gpu_bytes=1 << 24, cpu_bytes=1 << 24, io_depth=io_depth,
                                nvme_bytes=(1 << 24) if nvme else 0, nvme_path=nvme)
    kw = dict(lock_free=True, max_staleness=staleness, loss_scale=None, optimizer_tier="cpu") if lock_free else \
        dict(optimizer_tier=tier)
    cfg = pagemem.EngineConfig(store=store, optimizer=pagemem.AdamW(lr=lr, betas=(beta, 0.999)), compute_dtype=dtype,
                               staleness_correction=correction, **kw)
    plain = json.loads(json.dumps(to_plain(cfg)))
    assert pagemem.EngineConfig.from_dict(plain) == cfg
    assert plain["compute_dtype"] == str(dtype).removeprefix("torch.")
    # every key is a field name: one name per knob
    assert set(plain) == {f.name for f in dataclasses.fields(pagemem.EngineConfig)}
    assert set(plain["store"]) == {f.name for f in dataclasses.fields(pagemem.StoreConfig) if f.init}


def test_errors_name_the_dotted_field():
    base = to_plain(pagemem.EngineConfig(store=STORE))
    with pytest.raises(pagemem.ConfigError, match=r"^store\.io_depth: "):
        from_plain(pagemem.EngineConfig, with_overrides(base, {"store.io_depth": "0"}))
    with pytest.raises(pagemem.ConfigError, match=r"^optimizer\.lr: "):
        from_plain(pagemem.EngineConfig, with_overrides(base, {"optimizer.lr": "-1"}))
    with pytest.raises(pagemem.ConfigError, match=r"^store\.gpu_bites: unknown key"):
        from_plain(pagemem.EngineConfig, {**base, "store": {**base["store"], "gpu_bites": 1}})
    with pytest.raises(pagemem.ConfigError, match=r"^compute_dtype: must be one of"):
        from_plain(pagemem.EngineConfig, {**base, "compute_dtype": "float64"})
    with pytest.raises(pagemem.ConfigError, match=r"^optimizer\.lrr: unknown setting"):
        with_overrides(base, {"optimizer.lrr": "1"}, pagemem.EngineConfig)
    with pytest.raises(pagemem.ConfigError, match=r"^store: must be a pagemem.StoreConfig"):
        from_plain(pagemem.EngineConfig, {**base, "store": 3})


def test_overrides_read_toml_values_and_fall_back_to_strings():
    assert parse_value("3e-4") == 3e-4
    assert parse_value("true") is True
    assert parse_value("[0.9, 0.95]") == [0.9, 0.95]
    assert parse_value("2GiB") == "2GiB"
    assert parse_value("/tmp/x y") == "/tmp/x y"
    assert parse_value("none") is None
    base = to_plain(pagemem.EngineConfig(store=STORE))
    cfg = from_plain(pagemem.EngineConfig, with_overrides(base, {"store.gpu_bytes": "32MiB",
                                                                  "optimizer.betas": "[0.8, 0.9]",
                                                                  "compute_dtype": "bfloat16"}, pagemem.EngineConfig))
    assert cfg.store.gpu_bytes == 32 << 20 and cfg.optimizer.betas == (0.8, 0.9)
    assert cfg.compute_dtype == torch.bfloat16
    assert "store.gpu_bytes" in field_names(pagemem.EngineConfig) and "optimizer.lr" in field_names(pagemem.EngineConfig)
