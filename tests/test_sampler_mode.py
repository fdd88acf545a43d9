"""`[backend] sampler`: auto/exact/fast, resolved per device; explicit fast on a model the
fast sampler cannot run is a one-line config error; the backend samples through the mode."""

from __future__ import annotations

import pytest

from retrain.backends.sampler_mode import resolve
from retrain.cli.explain import sampler_line
from retrain.config.sections import ConfigError, from_dict


def test_auto_is_exact_on_cpu_and_fast_on_cuda():
    assert [resolve("auto", d) for d in ("cpu", "mps", "cuda")] == ["exact", "exact", "fast"]
    assert resolve("exact", "cuda") == "exact" and resolve("fast", "cpu") == "fast"
    assert from_dict({}).backend.sampler == "auto"
    with pytest.raises(ConfigError, match="did you mean 'fast'"):
        from_dict({"backend": {"sampler": "fats"}})
    with pytest.raises(ConfigError, match="backend.sampler"):
        from_dict({"backend": {"samplr": "fast"}})


def test_explain_names_the_resolved_sampler():
    assert sampler_line("auto", "cpu").startswith("exact (") and "auto on cpu" in \
        sampler_line("auto", "cpu")
    assert sampler_line("auto", "cuda").startswith("fast (")
    assert sampler_line("fast", "cpu").startswith("fast (")


torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.backends.base import SamplingParams  # noqa: E402
from retrain.backends.counter_rng import CounterDraws  # noqa: E402
from retrain.backends.local import LocalBackend  # noqa: E402
from retrain.backends.local_sampling import sample_batch  # noqa: E402
from retrain.errors import UserError  # noqa: E402


def _backend(tiny_model, sampler: str) -> LocalBackend:
    cfg = from_dict({"model": {"name": tiny_model, "dtype": "float32", "device": "cpu",
                               "threads": 1}, "backend": {"sampler": sampler},
                     "training": {"max_tokens": 64}})  # within the tiny model's context
    return LocalBackend.from_config(cfg)


def test_the_backend_samples_through_the_mode(tiny_model):
    assert _backend(tiny_model, "auto").model.fast is None  # CPU: today's sampler
    backend = _backend(tiny_model, "fast")
    m = backend.model
    assert m.fast is not None and "fast sampler" in m.summary
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=9)
    got = backend.sample([[1, 5, 9], [1, 7]], 2, params)
    assert got == backend.sample([[1, 5, 9], [1, 7]], 2, params)
    m.activate(backend.adapter)
    ref = sample_batch(m.net.eval(), [[1, 5, 9], [1, 7]], 2, params, eos_ids=m.eos_ids,
                       pad_id=m.pad_id, generator=CounterDraws([9, 9], [0, 1], 2, m.device),
                       make_cache=backend._make_cache, cache_key=m.cache_key)
    assert [[c.tokens for c in g] for g in got] == [[c.tokens for c in g] for g in ref]
    alone = backend.sample([[1, 7]], 2, params, prompt_seeds=[4])
    both = backend.sample([[1, 5, 9], [1, 7]], 2, params, prompt_seeds=[3, 4])
    assert [c.tokens for c in alone[0]] == [c.tokens for c in both[1]]


def test_fast_on_a_model_it_cannot_run_is_a_config_error(tiny_model):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from retrain.backends.local_model import LocalModel

    tok = AutoTokenizer.from_pretrained(tiny_model)
    net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64,
                                     vocab_size=len(tok)))
    model = LocalModel(net, tok, torch.device("cpu"), "gpt2-tiny")
    LocalBackend.new_adapter(model, "default", lora_rank=2)
    with pytest.raises(UserError, match="model type 'gpt2'.*sampler = \"exact\""):
        model.use_sampler("fast")
    model.use_sampler("auto")
    assert model.fast is None
