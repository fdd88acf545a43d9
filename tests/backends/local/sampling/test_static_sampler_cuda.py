"""The fast sampler's CUDA graphs: captured once per shape, replayed after an AdamW step
(merged buffers refreshed in place), the same tokens and log-probs as the eager steps."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device: CUDA graphs capture only there (bench/gpu/main.py checks "
                "the same on a GPU machine)", allow_module_level=True)

from retrain.backends.base import AdamParams, LossConfig, SamplingParams, make_datum  # noqa: E402
from retrain.backends.local.backend import LocalBackend  # noqa: E402
from retrain.backends.local.model import LocalModel  # noqa: E402
from retrain.backends.local.sampling.fast import StaticSampler  # noqa: E402


def _sample(sampler, backend, prompts, params):
    m = backend.model
    m.activate(backend.adapter)
    return sampler.sample(m.net.eval(), backend.adapter, prompts, 2, params,
                          seeds=[1] * len(prompts), prompt_ids=list(range(len(prompts))),
                          eos_ids=set(), pad_id=m.pad_id, make_cache=backend._make_cache,
                          cache_key=m.cache_key)


def test_graphs_replayed_after_an_adamw_step_give_the_eager_steps(tiny_model):
    model = LocalModel.load(tiny_model, "float32", "cuda", 1)
    backend = LocalBackend.new_adapter(model, "g", lora_rank=4, seed=1)
    prompts = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 8]]
    params = SamplingParams(max_tokens=40, temperature=1.0)
    graphed = StaticSampler(model.base, model.device, merged=True)
    before = _sample(graphed, backend, prompts, params)
    captures = graphed.graphs.captures
    assert captures >= 1
    datums = [make_datum(p, c, 1.0) for p, g in zip(prompts, before, strict=True) for c in g]
    backend.forward_backward(datums, LossConfig())
    backend.optim_step(AdamParams(learning_rate=1e-2))
    after = _sample(graphed, backend, prompts, params)
    assert graphed.graphs.captures == captures and graphed.graphs.replays > 0
    plain = StaticSampler(model.base, model.device, merged=True, graphs=False)
    plain.window_step = graphed.window_step
    eager = _sample(plain, backend, prompts, params)
    assert graphed.weights["g"].refreshes == 2  # once at the first sample, once after the step
    for ga, gb in zip(after, eager, strict=True):
        for a, b in zip(ga, gb, strict=True):
            assert a.tokens == b.tokens
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-5
