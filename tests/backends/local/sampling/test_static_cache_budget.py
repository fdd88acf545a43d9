"""The fast sampler's static KV cache within a share of the free device memory (a fake free
figure here: off CUDA there is no bound), decodes that do not fit in one pass, each prompt's
own length limit, and the host read of a block of steps."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.backends.base import BackendOOMError, DivergedError, SamplingParams  # noqa: E402
from retrain.backends.local.sampling.fast_rows import Rows  # noqa: E402
from retrain.backends.local.sampling.static_cache import (  # noqa: E402
    CACHE_SHARE,
    Geometry,
    StatePool,
    StaticState,
    device_free_bytes,
)
from retrain.backends.stop_strings import StopWatch  # noqa: E402
from tests.backends.local.sampling.test_static_sampler import PROMPTS, _kw, _net, assert_same, fast  # noqa: E402
from tests.backends.local.sampling.test_static_sampler import backend as backend  # noqa: E402,F401 (the fixture)

GEO = Geometry(layers=2, kv_heads=2, head_dim=16, dtype=torch.float32,
               device=torch.device("cpu"))


def test_a_states_bytes_are_what_it_allocates():
    st = StaticState(GEO, 8, 128)
    held = sum(t.numel() * t.element_size() for t in st.rows())
    assert GEO.state_bytes(8, 128) == held  # the per-row buffers: all but two counters
    assert device_free_bytes(torch.device("cpu")) is None


def test_the_pool_keeps_within_its_share_of_the_free_memory():
    free = {"bytes": 10 * GEO.state_bytes(16, 128)}
    pool = StatePool(GEO, lambda: free["bytes"])
    assert pool.budget() == int(free["bytes"] * CACHE_SHARE)
    assert pool.max_bucket(128) == 64  # 4 x 16 rows fit 5 x 16 rows' bytes, 128 do not
    pool.get(32, 128)
    free["bytes"] -= GEO.state_bytes(32, 128)  # what the device says once it is allocated
    pool.get(16, 128)
    free["bytes"] -= GEO.state_bytes(16, 128)
    assert pool.budget() == int(10 * GEO.state_bytes(16, 128) * CACHE_SHARE)  # own counted
    pool.get(64, 128)  # 4 x 16 rows more: the least recently used shape is let go
    assert list(pool.states) == [(16, 128), (64, 128)] and pool.dropped == [(32, 128)]
    assert pool.held() <= pool.budget()
    assert StatePool(GEO, lambda: None).max_bucket(128) is None  # no bound off CUDA
    assert StatePool(GEO, lambda: GEO.state_bytes(4, 128)).max_bucket(128) == 0


def test_rows_the_budget_cannot_hold_at_once_are_decoded_in_passes(backend):
    from retrain.backends.local.sampling.fast import StaticSampler

    params = SamplingParams(max_tokens=30, temperature=1.0)
    args = (PROMPTS, 3, params, [7, 7, 7], [0, 1, 2])
    whole = fast(backend, *args)
    small = StaticSampler(backend.model.base, backend.model.device, merged=False,
                          check_every=5)
    small.free_bytes = lambda _: 2 * small.pool.geo.state_bytes(4, 64) + 1  # one bucket of 4
    got = fast(backend, *args, sampler=small)
    assert_same(got, whole, 1e-5)  # one prompt's 3 samples per pass, the same completions
    assert small._passes(PROMPTS, 3, params) == [[0], [1], [2]]
    assert small.pool.held() <= small.pool.budget()
    small.free_bytes = lambda _: 0  # the pool's own 4 rows are more than it may hold
    with pytest.raises(BackendOOMError, match="3 samples of 64 positions need a KV cache"):
        fast(backend, *args, sampler=small)


def test_each_prompt_stops_at_its_own_limit(backend):
    from retrain.backends.local.sampling.fast import StaticSampler

    params = SamplingParams(max_tokens=30, temperature=1.0)
    args = (PROMPTS, 2, params, [5, 5, 5], [0, 1, 2])
    whole = fast(backend, *args)
    sampler = StaticSampler(backend.model.base, backend.model.device, merged=False,
                            check_every=4)
    got = sampler.sample(_net(backend), backend.adapter, PROMPTS, 2, params, seeds=[5, 5, 5],
                         prompt_ids=[0, 1, 2], limits=[3, 30, 11], **_kw(backend))
    for g_got, g_whole, limit in zip(got, whole, [3, 30, 11], strict=True):
        for c, w in zip(g_got, g_whole, strict=True):
            assert c.tokens == w.tokens[:limit] and c.logprobs == pytest.approx(
                w.logprobs[:limit], abs=1e-5)
            cut = len(w.tokens) > limit
            assert c.finish_reason == ("length" if cut else w.finish_reason)


def test_the_host_read_keeps_each_rows_tokens_up_to_its_end():
    rows = Rows(3, {0}, StopWatch((), None), limits=[20, 3, 20])
    toks = torch.tensor([[5, 6, 0, 7], [5, 6, 7, 8], [9, 9, 9, 9]])
    lps = torch.tensor([[-1.0, -2.0, -3.0, float("nan")]] * 3)  # after row 0's EOS: dropped
    with pytest.raises(DivergedError):  # row 2 keeps its NaN
        Rows(3, {0}, StopWatch((), None)).collect(toks, lps)
    rows.collect(toks, lps.nan_to_num(-4.0))
    assert rows.tokens == [[5, 6, 0], [5, 6, 7], [9, 9, 9, 9]]
    assert rows.stopped == [True, False, False] and rows.live == [(2, 2)]
    assert rows.logprobs[0] == [-1.0, -2.0, -3.0]
