"""The fast sampler on each model family it runs (Llama 3 with its rope scaling, Qwen2.5 with
its q/k/v biases, Qwen3 with q/k RMSNorm and a head size that is not hidden / heads), tied
and untied heads, LoRA on every linear layer and on the head: in float32 its tokens are the
transformers loop's with the same draws, and its log-probs are the transformers forward's
(the trainer's recompute) within 1e-5."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.backends.base import SamplingParams, make_datum  # noqa: E402
from retrain.backends.local.backend import LocalBackend  # noqa: E402
from retrain.backends.local.model import LocalModel  # noqa: E402
from retrain.backends.local.sampling.counter_rng import CounterDraws  # noqa: E402
from retrain.backends.local.sampling.exact import sample_batch  # noqa: E402
from retrain.backends.local.sampling.fast import StaticSampler  # noqa: E402
from tests.sampler_helpers import lora_b_off_zero, model_kw  # noqa: E402

EVERY_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "lm_head"]
PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 8]]
LOGPROB_TOL = 1e-5


def _family(name: str):
    """(config class, model class, the family's own settings) of a small random model."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {
        # Llama 3.x: rope scaling that changes the low frequencies from position 8 on
        "llama3": (LlamaConfig, LlamaForCausalLM, dict(rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(rope_theta=1000000.0)),  # q/k/v biases
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=24, rope_theta=1000000.0)),
    }[name]


def _backend(tiny_model: str, family: str, tied: bool) -> LocalBackend:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    config_cls, model_cls, own = _family(family)
    cfg = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=96,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256, tie_word_embeddings=tied,
                     initializer_range=0.2, bos_token_id=tok.bos_token_id,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **own)
    torch.manual_seed(0)
    net = model_cls(cfg).float().eval()
    model = LocalModel(net, tok, torch.device("cpu"), f"{family}-tiny")
    backend = LocalBackend.new_adapter(model, "default", lora_rank=4, seed=1,
                                       target_modules=EVERY_LINEAR)
    return lora_b_off_zero(backend, 2)  # every adapter changes the logits


def _net(backend: LocalBackend):
    backend.model.activate(backend.adapter)
    return backend.model.net.eval()


def _assert_same(got, ref) -> None:
    for ga, gb in zip(got, ref, strict=True):
        for a, b in zip(ga, gb, strict=True):
            assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
            worst = max((abs(x - y) / max(1.0, abs(y))
                         for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0.0)
            assert worst <= LOGPROB_TOL, worst


def _trainer_gap(backend: LocalBackend, groups) -> float:
    """The largest |sampled log-prob - the trainer's forward of the same tokens|."""
    datums = [make_datum(p, c, 0.0) for p, g in zip(PROMPTS, groups, strict=True) for c in g]
    worst = 0.0
    for d, lp in zip(datums, backend.logprobs(datums), strict=True):
        for m, s, t in zip(d.mask, d.logprobs, lp, strict=True):
            if m > 0:
                worst = max(worst, abs(s - t) / max(1.0, abs(t)))
    return worst


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_the_fast_sampler_matches_the_transformers_forward(tiny_model, family, tied):
    backend = _backend(tiny_model, family, tied)
    base = backend.model.base
    embed = base.get_input_embeddings().weight
    before = embed.detach().clone()
    backend.model.use_sampler("fast")  # a family the fast sampler runs: no config error
    assert backend.model.fast is not None
    draws = {"seeds": [7, 7, 7], "prompt_ids": [0, 1, 2]}

    def reference(params):
        return sample_batch(_net(backend), PROMPTS, 3, params, **model_kw(backend),
                            generator=CounterDraws(**draws, n=3, device=backend.model.device))

    free = reference(SamplingParams(max_tokens=30, temperature=1.0))
    # a stop token drawn early in one row: rows end at different steps
    params = SamplingParams(max_tokens=30, temperature=1.0,
                            stop_tokens=(free[0][0].tokens[4],))
    args = (PROMPTS, 3, params)
    ref = reference(params)
    for merged in (False, True):
        sampler = StaticSampler(base, backend.model.device, merged=merged, check_every=5)
        got = sampler.sample(_net(backend), "default", *args, **draws, **model_kw(backend))
        _assert_same(got, ref)
        assert _trainer_gap(backend, got) <= LOGPROB_TOL
    assert len({len(c.tokens) for g in ref for c in g}) > 1
    head = base.get_output_embeddings()
    assert hasattr(head, "lora_A")  # the head itself carries the adapter
    # the merged head is a buffer of its own: the (shared) embedding never changes
    assert torch.equal(embed, before)
    assert (head.base_layer.weight.data_ptr() == embed.data_ptr()) is tied
