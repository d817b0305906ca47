"""[Note: sharded checkpoints]: a sharded moment's place in the manifest is pieces that follow one
another over the whole parameter; ``merge_shares`` builds them from every rank's share, and the
manifest's check refuses pieces with a gap, an overlap or a wrong total."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from pagemem.engine.checkpoints import manifest as mf
from pagemem.engine.checkpoints.page_files import merge_shares

PB = 4096


@st.composite
def shares(draw):
    """A parameter of ``n`` elements cut into consecutive shares, each placed from the start of a
    page of its own rank's region of the file."""
    n = draw(st.integers(1, 5000))
    world = draw(st.integers(1, 4))
    cuts = sorted(draw(st.lists(st.integers(0, n // 64), min_size=world - 1, max_size=world - 1)))
    bounds = [0] + [64 * c for c in cuts] + [n]
    parts, page = [], 0
    for a, b in zip(bounds, bounds[1:]):
        if b <= a:
            parts.append(([None], []))
            continue
        pages = -(-(b - a) * 4 // PB)
        parts.append(([{"pages": list(range(page, page + pages)), "offset": 0, "nbytes": (b - a) * 4, "start": a}],
                      [0] * pages))
        page += pages
    return n, parts, page


@given(shares())
def test_merged_shares_are_pieces_the_manifest_accepts(case):
    n, parts, pages = case
    places, digests = merge_shares(parts)
    assert len(digests) == pages and len(places) == 1
    pieces = places[0]["pieces"]
    assert [p["start"] for p in pieces] == sorted(p["start"] for p in pieces)
    mf._pieces(places[0], "tensors.exp_avg[0]", PB, pages, n * 4)


@given(shares(), st.sampled_from(["gap", "overlap", "short", "start"]))
def test_pieces_that_do_not_tile_the_parameter_are_refused(case, damage):
    n, parts, pages = case
    place = merge_shares(parts)[0][0]
    pieces = place["pieces"]
    if damage == "gap" or damage == "overlap":
        if len(pieces) < 2:
            return
        pieces[1]["start"] += 1 if damage == "gap" else -1
    elif damage == "short":
        if pieces[-1]["nbytes"] <= 4:
            return
        pieces[-1]["nbytes"] -= 4
    else:
        pieces[0]["start"] = 64
    with pytest.raises(mf.PageMemError):
        mf._pieces(place, "tensors.exp_avg[0]", PB, pages, n * 4)
