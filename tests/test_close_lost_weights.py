"""[Note: weights given back one by one] ``close()`` with master weights that cannot be read back
(a corrupt page, a failed read): every other parameter keeps its trained weights, the ones that
failed refuse every read, close still releases everything, then one error names them all and
says to load a checkpoint."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pagemem
from pagemem.errors import CorruptPage, TierIOError, WeightsNotGivenBack
from pagemem.tiers.io import FaultyEngine

from test_engine_checkpoint import make, train
from test_faults import flip_byte


def master_pages(engine) -> dict[int, set[str]]:
    """Each page holding master weights: the parameters whose master weights it holds."""
    out: dict[int, set[str]] = {}
    for i, (name, _) in enumerate(engine.bank.params):
        layer, k = engine.bank.where(i)
        for page in layer.master[k].pages:
            out.setdefault(page, set()).add(name)
    return out


def trained(tmp_path, optimizer_tier: str):
    model, cfg = make(tmp_path, optimizer_tier=optimizer_tier)
    engine = pagemem.Engine(model, cfg)
    train(engine, 2)
    return engine, model, engine.state_dict()


def corrupt_on_disk(engine, pages) -> None:
    """Flip a byte of each page (its only copy is on nvme)."""
    for page in pages:
        assert set(engine.store.copies(page)) == {"nvme"}
        flip_byte(engine.store, page)


def corrupt_in_host_memory(engine, pages, monkeypatch) -> None:
    """A cpu page carries no checksum, so no flipped byte of one is ever found; stand in for a
    damaged host page by making every read of one raise CorruptPage, as a checksum would."""
    store = engine.store
    real = type(store).read
    bad = set(pages)

    def read(t):
        hit = bad.intersection(t.pages)
        if hit:
            page = min(hit)
            raise CorruptPage(*store.location(page), 1, 2, "planted")
        return real(store, t)

    monkeypatch.setattr(store, "read", read, raising=False)


def check_closed(engine, model, expected, err, bad: set[str], cls=WeightsNotGivenBack) -> None:
    assert isinstance(err, cls), err
    assert set(err.lost) == bad
    text = str(err)
    for name in bad:
        assert repr(name) in text
    assert "load a checkpoint into a fresh model" in text and f"other {len(dict(model.named_parameters())) - len(bad)} parameter(s)" in text
    assert engine.store.closed and engine.guard.closed
    assert not [n for n in os.listdir(engine.store.config.nvme_path) if n.endswith(".pages")]
    for name, p in model.named_parameters():
        if name in bad:  # never a placeholder's value
            assert not type(p) is torch.nn.Parameter
            with pytest.raises(pagemem.InvalidRequest, match=f"{name}.*could not be read back"):
                p * 1
            assert tuple(p.shape) == tuple(expected[name].shape)  # metadata still answers
        else:
            assert type(p) is torch.nn.Parameter
            assert torch.equal(p.detach(), expected[name]), name


def close_error(engine):
    try:
        engine.close()
    except pagemem.PageMemError as exc:
        return exc
    return None


@pytest.mark.parametrize("tier", ["nvme", "cpu"])
@pytest.mark.parametrize("which", ["one", "several", "all"])
def test_close_gives_back_every_good_parameter_and_names_the_bad_ones(tmp_path, monkeypatch, tier, which):
    engine, model, expected = trained(tmp_path, tier)
    pages = sorted(master_pages(engine))
    chosen = {"one": pages[len(pages) // 2:len(pages) // 2 + 1], "several": pages[::3], "all": pages}[which]
    bad = set().union(*(master_pages(engine)[p] for p in chosen))
    if tier == "nvme":
        corrupt_on_disk(engine, chosen)
    else:
        corrupt_in_host_memory(engine, chosen, monkeypatch)
    err = close_error(engine)
    assert isinstance(err, CorruptPage)  # what users catch
    assert err.tier == tier
    check_closed(engine, model, expected, err, bad)
    assert close_error(engine) is None  # closed once is closed


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_set_of_corrupt_master_pages_costs_only_their_parameters(tmp_path_factory, data):
    tmp_path = tmp_path_factory.mktemp("corrupt")
    engine, model, expected = trained(tmp_path, "nvme")
    owners = master_pages(engine)
    chosen = data.draw(st.sets(st.sampled_from(sorted(owners))), label="corrupt pages")
    corrupt_on_disk(engine, chosen)
    err = close_error(engine)
    bad = set().union(set(), *(owners[p] for p in chosen))
    if not bad:
        assert err is None
        assert all(torch.equal(p.detach(), expected[n]) for n, p in model.named_parameters())
        return
    check_closed(engine, model, expected, err, bad)


def test_a_failed_read_at_close_costs_only_its_parameter(tmp_path):
    engine, model, expected = trained(tmp_path, "nvme")
    nvme = engine.store.tier("nvme")
    nvme.engine = faults = FaultyEngine(nvme.engine)
    faults.fail_next("read", "eio", count=1)  # the first master read at close: wte.weight's
    err = close_error(engine)
    assert faults.injected == 1
    assert isinstance(err, TierIOError) and not isinstance(err, CorruptPage)
    check_closed(engine, model, expected, err, {"wte.weight"}, cls=TierIOError)


def test_the_parameters_close_could_not_give_back_come_back_from_a_checkpoint(tmp_path):
    engine, model, expected = trained(tmp_path, "nvme")
    ckpt = engine.save(str(tmp_path / "ckpt"))
    owners = master_pages(engine)
    page = sorted(owners)[1]
    corrupt_on_disk(engine, [page])
    err = close_error(engine)
    assert isinstance(err, WeightsNotGivenBack) and set(err.lost) == owners[page]
    fresh, cfg = make(tmp_path)  # as the error says: this module's refused parameters are done with
    with pagemem.Engine.load(ckpt, fresh, cfg) as again:
        got = again.state_dict()
    for name, p in fresh.named_parameters():
        assert torch.equal(got[name], expected[name]) and torch.equal(p.detach(), expected[name]), name
