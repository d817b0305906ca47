from hypothesis import given
from hypothesis import strategies as st

from pagemem.store.layout import TENSOR_ALIGN, pack

sizes = st.lists(st.integers(0, 50_000), min_size=1, max_size=30)
page_sizes = st.sampled_from([4096, 8192, 65536])


@given(sizes, page_sizes)
def test_tensors_are_disjoint_aligned_and_in_order(sz, pb):
    lay = pack(sz, pb)
    prev_end = 0
    for start, size in zip(lay.starts, lay.sizes):
        assert start >= prev_end
        if size:
            assert start % TENSOR_ALIGN == 0
            assert start - prev_end < TENSOR_ALIGN
            prev_end = start + size
    assert lay.pages == -(-prev_end // pb)


@given(sizes, page_sizes)
def test_page_span_covers_exactly_the_tensor(sz, pb):
    lay = pack(sz, pb)
    for i, size in enumerate(lay.sizes):
        span = lay.page_span(i)
        if size == 0:
            assert len(span) == 0
            continue
        assert span.start * pb <= lay.starts[i] < (span.start + 1) * pb
        end = lay.starts[i] + size
        assert (span.stop - 1) * pb < end <= span.stop * pb
        assert span.stop <= lay.pages


def test_small_tensors_share_a_page():
    lay = pack([100, 200, 300, 4000], 4096)
    assert lay.pages == 2  # 100+200+300 padded to 256 each, then 4000: 768 + 4000 > 4096
    assert [len(lay.page_span(i)) for i in range(4)] == [1, 1, 1, 2]


def test_big_tensor_may_start_and_end_mid_page():
    lay = pack([1000, 3 * 4096], 4096)
    assert lay.starts[1] == 1024
    assert list(lay.page_span(1)) == [0, 1, 2, 3]
    assert lay.pages == 4


@given(sizes, page_sizes, st.integers(0, 65535))
def test_pack_can_continue_a_partly_filled_page(sz, pb, start):
    start %= pb
    lay = pack(sz, pb, start=start)
    assert all(s >= start for s in lay.starts)
    assert lay.end >= start and lay.pages == -(-lay.end // pb)
