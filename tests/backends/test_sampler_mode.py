"""`[backend] sampler`: auto/exact/fast, resolved per device; explicit fast on a model the
fast sampler cannot run is a one-line config error; the backend samples through the mode."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from retrain.backends.sampler_mode import FAST_FAMILIES, choose, resolve
from retrain.cli.explain.dry_run import sampler_line
from retrain.cli.explain.memory import model_family
from retrain.config.sections import ConfigError, from_dict


def test_auto_is_exact_on_cpu_and_fast_on_cuda():
    assert [resolve("auto", d) for d in ("cpu", "mps", "cuda")] == ["exact", "exact", "fast"]
    assert resolve("exact", "cuda") == "exact" and resolve("fast", "cpu") == "fast"
    assert from_dict({}).backend.sampler == "auto"
    with pytest.raises(ConfigError, match="did you mean 'fast'"):
        from_dict({"backend": {"sampler": "fats"}})
    with pytest.raises(ConfigError, match="backend.sampler"):
        from_dict({"backend": {"samplr": "fast"}})


def test_a_ratio_cap_below_one_is_refused_naming_the_key():
    assert from_dict({"backend": {"fast_ratio_cap": 0}}).backend.fast_ratio_cap == 0
    with pytest.raises(ConfigError, match="backend.fast_ratio_cap.*cut on-policy tokens"):
        from_dict({"backend": {"fast_ratio_cap": 0.5}})


def test_explain_names_the_resolved_sampler():
    assert sampler_line("auto", "cpu").startswith("exact (") and "auto on cpu" in \
        sampler_line("auto", "cpu")
    assert sampler_line("auto", "cuda").startswith("fast (")
    assert sampler_line("fast", "cpu").startswith("fast (")


def test_the_choice_says_why_for_the_models_family():
    assert set(FAST_FAMILIES) == {"llama", "qwen2", "qwen3"}
    assert choose("auto", "cuda", "qwen3").mode == "fast"
    gpt2 = choose("auto", "cuda", "gpt2")
    assert gpt2.mode == "exact" and "model type 'gpt2'" in gpt2.why
    assert choose("auto", "cuda", "qwen2", ["full_attention", "sliding_attention"]).mode == \
        "exact"
    assert choose("auto", "cpu", "qwen3").mode == "exact"
    assert "config error" in choose("fast", "cuda", "gpt2").why
    assert choose("exact", "cuda", "llama").mode == "exact"
    line = sampler_line("auto", "cuda", "gpt2")
    assert line.startswith("exact (") and "cannot run model type 'gpt2'" in line
    assert "checked when it loads" in sampler_line("auto", "cuda")


def test_explain_reads_the_family_from_the_model_folder(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3", "layer_types": '
                                        '["full_attention"]}')
    assert model_family("m", tmp_path) == ("qwen3", ["full_attention"])
    assert model_family("not-here", tmp_path) == (None, None)
    (folder / "config.json").write_text("{not json")
    assert model_family("m", tmp_path) == (None, None)


torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.backends.base import Datum, LossConfig, SamplingParams  # noqa: E402
from retrain.backends.local.backend import LocalBackend  # noqa: E402
from retrain.backends.local.sampling.counter_rng import CounterDraws  # noqa: E402
from retrain.backends.local.sampling.exact import sample_batch  # noqa: E402
from retrain.errors import UserError  # noqa: E402
from tests.sampler_helpers import lora_b_off_zero  # noqa: E402


def _backend(tiny_model, sampler: str) -> LocalBackend:
    cfg = from_dict({"model": {"name": tiny_model, "dtype": "float32", "device": "cpu",
                               "threads": 1}, "backend": {"sampler": sampler},
                     "training": {"max_tokens": 64}})  # within the tiny model's context
    return LocalBackend.from_config(cfg.model, cfg.training, cfg.backend)


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
    alone = backend.sample([[1, 7]], 2, replace(params, prompt_seeds=(4,)))
    both = backend.sample([[1, 5, 9], [1, 7]], 2, replace(params, prompt_seeds=(3, 4)))
    assert [c.tokens for c in alone[0]] == [c.tokens for c in both[1]]


def test_fast_on_a_model_it_cannot_run_is_a_config_error(tiny_model):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from retrain.backends.local.model import LocalModel

    tok = AutoTokenizer.from_pretrained(tiny_model)
    net = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, n_positions=64,
                                     vocab_size=len(tok)))
    model = LocalModel(net, tok, torch.device("cpu"), "gpt2-tiny")
    LocalBackend.new_adapter(model, "default", lora_rank=2)
    with pytest.raises(UserError, match="model type 'gpt2'.*sampler = \"exact\""):
        model.use_sampler("fast")
    model.use_sampler("auto")
    assert model.fast is None and "exact sampler" not in model.summary  # CPU: never fast
    model.device = torch.device("cuda")  # what auto resolves against (nothing runs there)
    model.use_sampler("auto")
    assert model.fast is None
    assert model.summary.endswith(", exact sampler (auto: the fast sampler cannot run model "
                                  "type 'gpt2' (the fast sampler knows llama, qwen2, qwen3))")


def _far_from_the_sampler(backend, gap: float) -> list[Datum]:
    """Two sampled completions whose recorded sampler log-probs sit `gap` below the trainer's:
    every ratio is exp(gap)."""
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    done = backend.sample([[1, 5, 9]], 2, params)[0]
    return [Datum(input_tokens=[1, 5, 9, *c.tokens[:-1]], target_tokens=[5, 9, *c.tokens],
                  logprobs=[0.0, 0.0, *(lp - gap for lp in c.logprobs)],
                  advantages=[0.0, 0.0, *[1.0] * len(c.tokens)],
                  mask=[0.0, 0.0, *[1.0] * len(c.tokens)]) for c in done]


def test_the_fast_sampler_truncates_the_ratio_at_its_cap(tiny_model):
    """[backend] fast_ratio_cap: with the fast sampler a token's ratio counts at most the cap
    (the loss is -cap x A per token) and the row counts the tokens cut; the exact sampler's
    update is the plain importance-sampling one."""
    loss = LossConfig("importance_sampling")
    fast = _backend(tiny_model, "fast")
    assert fast.fast_ratio_cap == 2.0   # the documented default
    out = fast.forward_backward(_far_from_the_sampler(fast, 1.0), loss)   # ratios e ~ 2.72
    assert out.metrics["ratio_truncated"] == 1.0
    assert out.loss == pytest.approx(-2.0, rel=1e-4)
    assert out.metrics["ratio_mean"] == pytest.approx(math.e, rel=1e-4)
    exact = _backend(tiny_model, "exact")
    plain = exact.forward_backward(_far_from_the_sampler(exact, 1.0), loss)
    assert "ratio_truncated" not in plain.metrics
    assert plain.loss == pytest.approx(-math.e, rel=1e-4)
    below = fast.forward_backward(_far_from_the_sampler(fast, 0.5), loss)   # ratios ~1.65
    assert below.metrics["ratio_truncated"] == 0.0
    assert below.loss == pytest.approx(-math.exp(0.5), rel=1e-4)


@pytest.mark.parametrize("sampler", ["exact", "fast"])
def test_a_steps_groups_sample_alike_in_one_call_or_split(tiny_model, sampler):
    """Distributed ranks each sample a share of a step's groups: with the groups' seeds keyed
    by their number in the step (rollout.keyed), any split gives the same tokens as one call,
    and the same log-probs to float32 rounding (another batch shape, other matmul blocking)."""
    from retrain.environments.rollout import keyed

    backend = lora_b_off_zero(_backend(tiny_model, sampler), seed=3)
    prompts = [[1, 5, 9, 4, 3, 3], [1, 7], [1, 6, 2, 5], [1, 9, 9]]  # unequal: padding differs
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=21)
    whole = backend.sample(prompts, 3, keyed(params, range(4)))
    split = (backend.sample(prompts[:1], 3, keyed(params, [0]))
             + backend.sample(prompts[1:], 3, keyed(params, range(1, 4))))
    assert _tokens(split) == _tokens(whole)
    assert _logprobs(split) == pytest.approx(_logprobs(whole), rel=1e-5, abs=1e-5)
    shifted = backend.sample(prompts[1:], 3, keyed(params, range(3)))  # keyed by place: differs
    assert _tokens(shifted) != _tokens(whole[1:])


def _tokens(groups) -> list:
    return [[c.tokens for c in g] for g in groups]


def _logprobs(groups) -> list[float]:
    return [lp for g in groups for c in g for lp in c.logprobs]
