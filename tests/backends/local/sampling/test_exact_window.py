"""The exact sampler with a window of k device steps between host reads (its CUDA setting,
forced here on the CPU) gives the step-by-step loop's completions with the same draws
(float32): the same tokens, finishes, top log-probs and `on_token` calls in the same order,
log-probs within 1e-5 (finished rows stay in the batch until the read: matmuls over another
number of rows round the last bits differently), the same DivergedError, and the same rows
leaving the batch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.backends.base import DivergedError, SamplingParams  # noqa: E402
from retrain.backends.local.backend import LocalBackend  # noqa: E402
from retrain.backends.local.sampling.counter_rng import CounterDraws  # noqa: E402
from retrain.backends.local.sampling.exact import sample_batch  # noqa: E402
from retrain.backends.sampler_mode import exact_window  # noqa: E402
from tests.sampler_helpers import lora_b_off_zero  # noqa: E402

PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 8]]
TOL = 1e-5


@pytest.fixture(scope="module")
def backend(model) -> LocalBackend:
    return lora_b_off_zero(LocalBackend.new_adapter(model, "window", lora_rank=4, seed=1), 0)


def _sample(backend, params, window, generator, n=3, heard=None, **kw):
    m = backend.model
    m.activate(backend.adapter)
    heard = [] if heard is None else heard
    out = sample_batch(m.net.eval(), PROMPTS, n, params, eos_ids=m.eos_ids, pad_id=m.pad_id,
                       generator=generator(), make_cache=backend._make_cache,
                       cache_key=m.cache_key, decode=m.tokenizer.decode, window=window,
                       on_token=lambda *a: heard.append(a), **kw)
    return out, heard


def _close(a: list[float], b: list[float]) -> bool:
    return all(abs(x - y) <= TOL * max(1.0, abs(y)) for x, y in zip(a, b, strict=True))


def assert_same(got, want) -> None:
    (groups_a, heard_a), (groups_b, heard_b) = got, want
    for ga, gb in zip(groups_a, groups_b, strict=True):
        for a, b in zip(ga, gb, strict=True):
            assert (a.tokens, a.finish_reason) == (b.tokens, b.finish_reason)
            assert _close(a.logprobs, b.logprobs)
            if b.top_logprobs is not None:
                for pa, pb in zip(a.top_logprobs, b.top_logprobs, strict=True):
                    assert [t for t, _ in pa] == [t for t, _ in pb]
                    assert _close([v for _, v in pa], [v for _, v in pb])
    assert [(i, t) for i, t, _, _ in heard_a] == [(i, t) for i, t, _, _ in heard_b]
    assert _close([lp for _, _, lp, _ in heard_a], [lp for _, _, lp, _ in heard_b])


DRAWS = {
    "one generator": lambda: torch.Generator().manual_seed(3),
    "one per prompt": lambda: [torch.Generator().manual_seed(s) for s in (4, 5, 6)],
    "counter": lambda: CounterDraws([7, 7, 7], [0, 1, 2], 3, torch.device("cpu")),
}


@pytest.mark.parametrize("draws", list(DRAWS))
@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(0.0, 1.0, 0), (0.7, 1.0, 3),
                                                             (1.0, 0.8, 0)])
def test_a_window_gives_the_step_by_step_completions(backend, draws, temperature, top_p,
                                                     top_k):
    free = SamplingParams(max_tokens=40, temperature=temperature, top_p=top_p)
    stop = _sample(backend, free, 1, DRAWS[draws])[0][0][0].tokens[5]  # rows end mid-window
    params = SamplingParams(max_tokens=40, temperature=temperature, top_p=top_p,
                            top_logprobs=top_k, stop_tokens=(stop,))
    want = _sample(backend, params, 1, DRAWS[draws])
    assert len({len(c.tokens) for g in want[0] for c in g}) > 1  # rows end at other steps
    for window in (4, 16):
        assert_same(_sample(backend, params, window, DRAWS[draws]), want)


def test_stop_tokens_and_strings_inside_a_window(backend):
    free = SamplingParams(max_tokens=30, temperature=1.0)
    unstopped = _sample(backend, free, 1, DRAWS["one generator"])[0]
    decode = backend.model.tokenizer.decode
    stop_text = decode(unstopped[2][1].tokens[6:8])
    assert stop_text.strip()
    params = SamplingParams(max_tokens=30, temperature=1.0,
                            stop_tokens=(unstopped[1][0].tokens[9],), stop_strings=(stop_text,))
    want = _sample(backend, params, 1, DRAWS["one generator"])
    ends = [len(c.tokens) for g in want[0] for c in g if c.finish_reason == "stop"]
    assert any(e % 16 for e in ends)  # a stop inside a window: the tokens after it dropped
    assert_same(_sample(backend, params, 16, DRAWS["one generator"]), want)


def test_rows_leave_the_batch_as_the_step_by_step_loop_leaves_them(backend):
    def leaving():
        calls = []

        def leave():
            calls.append(1)
            return {0, 1, 4} if len(calls) == 7 else set()
        return leave

    params = SamplingParams(max_tokens=30, temperature=1.0)
    want = _sample(backend, params, 1, DRAWS["counter"], leave=leaving())
    assert [len(c.tokens) for c in want[0][0]][:2] == [6, 6]  # left after 6 tokens
    assert_same(_sample(backend, params, 4, DRAWS["counter"], leave=leaving()), want)


class _NanFrom:
    """The model, whose batch row 1 gets NaN logits from the `at`-th decoding step on."""

    def __init__(self, net, at: int):
        self.net, self.at, self.calls = net, at, 0

    def __call__(self, **kw):
        self.calls += 1
        out = self.net(**kw)
        if self.calls >= self.at:
            out.logits[1] = float("nan")
        return out


def test_a_non_finite_step_raises_before_any_of_its_tokens_is_heard(backend):
    params = SamplingParams(max_tokens=30, temperature=1.0)
    heard = {}
    for window in (1, 4, 16):
        with pytest.raises(DivergedError, match="not finite"):
            _sample(backend, params, window, DRAWS["counter"], heard=heard.setdefault(
                window, []), decoder=_NanFrom(backend.model.net, 5))
    steps = [[(i, t) for i, t, _, _ in heard[w]] for w in (1, 4, 16)]
    assert steps[0] == steps[1] == steps[2] and len(steps[0]) >= 5 * 2  # steps 0-4 heard


class _Counting:
    """The model, counting its decoding steps."""

    def __init__(self, net):
        self.net, self.calls = net, 0

    def __call__(self, **kw):
        self.calls += 1
        return self.net(**kw)


def test_the_backend_decodes_in_its_devices_window(backend):
    """The host hears the first token once the window's steps are decoded, not before."""
    assert exact_window("cpu") == 1 and exact_window("cuda") == 16
    m = backend.model
    assert m.exact_window == 1
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=5)
    got, first_heard = {}, {}
    try:
        for window in (1, 16):
            m.exact_window, m.decoder = window, _Counting(m.net)
            heard = []
            got[window] = backend.sample(PROMPTS, 2, params,
                                         on_token=lambda *a, d=m.decoder, h=heard:
                                         h.append(d.calls))
            first_heard[window] = heard[0]
    finally:
        m.exact_window, m.decoder = 1, None
    assert first_heard == {1: 0, 16: 15}  # decoding steps done when the first token is heard
    for ga, gb in zip(got[16], got[1], strict=True):
        assert [c.tokens for c in ga] == [c.tokens for c in gb]
