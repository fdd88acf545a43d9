"""The sampler's draw: one uniform per row through the cumulative distribution."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from retrain.backends.base import SamplingParams  # noqa: E402
from retrain.backends.local.sampling.exact import draw, inverse_cdf  # noqa: E402


def test_inverse_cdf_picks_the_token_whose_interval_holds_u():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]] * 5)
    u = torch.tensor([1e-9, 0.25, 0.2500001, 0.9, 1.0], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 3]  # zero-probability tokens never


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    lp = torch.log(probs).expand(20000, -1).contiguous()
    gen = torch.Generator().manual_seed(0)
    tok = draw(lp, SamplingParams(max_tokens=1, temperature=1.0), gen)
    counts = torch.bincount(tok, minlength=5).double() / tok.numel()
    sigma = (probs.double() * (1 - probs.double()) / tok.numel()).sqrt()
    assert counts[4] == 0
    assert ((counts - probs.double()).abs() <= 5 * sigma + 1e-12).all(), counts


def test_top_p_draws_only_from_the_nucleus():
    lp = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(4000, -1).contiguous()
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7)
    tok = draw(lp, params, torch.Generator().manual_seed(1))
    assert set(tok.tolist()) == {0, 1}


@pytest.mark.parametrize("top_p", [1e-50, 1e-46, 1e-30])
def test_a_top_p_below_float32s_least_keeps_the_top_token(top_p):
    """1e-50 is 0 in float32: every token's mass above it was >= 0, so all were dropped and
    the draw fell to token 0 (the pad token). The top token always stays in the nucleus."""
    lp = torch.log(torch.tensor([0.1, 0.2, 0.6, 0.1])).expand(100, -1).contiguous()
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=top_p)
    assert set(draw(lp, params, torch.Generator().manual_seed(3)).tolist()) == {2}


def test_per_row_generators_give_each_row_its_own_stream():
    lp = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(2)), -1)
    params = SamplingParams(max_tokens=1, temperature=1.0)

    def rows(seeds):
        return draw(lp, params, [torch.Generator().manual_seed(s) for s in seeds]).tolist()

    assert rows([1, 2, 3]) == rows([1, 2, 3])
    alone = draw(lp[1:2], params, [torch.Generator().manual_seed(2)]).tolist()
    assert rows([1, 2, 3])[1] == alone[0]
