"""The local backend on the tiny model, in float32 where exactness matters."""

from __future__ import annotations

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.backends.base import (  # noqa: E402
    AdamParams,
    BackendError,
    BackendOOMError,
    LossConfig,
    SamplingParams,
    make_datum,
)
from retrain.backends.local.backend import LocalBackend  # noqa: E402
from retrain.backends.local.training.plan import cpu_budget, plan  # noqa: E402
from retrain.backends.local.training.policy_losses import token_losses  # noqa: E402

EOS = 2


@pytest.fixture
def backend(model, tmp_path) -> LocalBackend:
    """A fresh adapter per test on the shared model (the sharing `retrain serve` relies on)."""
    name = f"t{len(model.lora_configs)}"
    b = LocalBackend.new_adapter(model, name, lora_rank=4, lora_alpha=8.0, seed=7,
                                 checkpoint_dir=tmp_path)
    yield b
    b.close()
    model.delete_adapter(name)


@pytest.fixture
def eos_bias(model):
    """Make EOS likely (for both sampler and trainer) so completions stop at varied lengths."""
    def hook(_module, _inputs, out):
        out = out.clone()
        out[..., EOS] += 4.0
        return out

    handle = model.base.get_output_embeddings().register_forward_hook(hook)
    yield
    handle.remove()


def prompts(model, questions=("hi", "what is 2+2?", "count to three please")):
    tok = model.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                    tokenize=True)["input_ids"] for q in questions]


def datums_for(ps, groups, adv=lambda i, j: (-1.0) ** j):
    return [make_datum(ps[i], c, adv(i, j)) for i, g in enumerate(groups) for j, c in enumerate(g)]


def max_logprob_diff(datums, out) -> float:
    return max(abs(a - b) for d, lps in zip(datums, out.logprobs, strict=True)
               for a, b, m in zip(d.logprobs, lps, d.mask, strict=True) if m)


def test_completions_stop_at_eos_and_nothing_follows(model, backend, eos_bias):
    ps = prompts(model)
    groups = backend.sample(ps, 8, SamplingParams(max_tokens=12, seed=1))
    assert [len(g) for g in groups] == [8, 8, 8]
    reasons = set()
    for c in (c for g in groups for c in g):
        assert len(c.tokens) == len(c.logprobs) <= 12
        assert EOS not in c.tokens[:-1], "a token after EOS"
        assert c.finish_reason == ("stop" if c.tokens[-1] == EOS else "length")
        assert c.finish_reason == "stop" or len(c.tokens) == 12
        assert all(lp <= 0.0 and lp > -1e9 for lp in c.logprobs)
        reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.8)])
def test_sampler_and_trainer_logprobs_agree_before_update(model, backend, eos_bias,
                                                          temperature, top_p):
    ps = prompts(model)  # different lengths: exercises left padding
    params = SamplingParams(max_tokens=16, temperature=temperature, top_p=top_p, seed=3)
    groups = backend.sample(ps, 4, params)
    datums = datums_for(ps, groups)
    out = backend.forward_backward(datums, LossConfig(temperature=temperature))
    assert max_logprob_diff(datums, out) < 1e-4
    backend._zero_grad()


def test_datum_shift_aligns_targets_with_sampled_tokens(model, backend):
    ps = prompts(model)
    groups = backend.sample(ps, 2, SamplingParams(max_tokens=6, seed=2))
    for i, g in enumerate(groups):
        for c in g:
            d = make_datum(ps[i], c, 0.5)
            assert d.input_tokens == (ps[i] + c.tokens)[:-1]
            kept = [t for t, m in zip(d.target_tokens, d.mask, strict=True) if m]
            assert kept == c.tokens
            assert [lp for lp, m in zip(d.logprobs, d.mask, strict=True) if m] == c.logprobs
            assert d.target_tokens[len(ps[i]) - 1] == c.tokens[0]


def test_sampling_is_seeded_and_leaves_global_rng_alone(model, backend):
    ps = prompts(model)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = backend.sample(ps, 3, SamplingParams(max_tokens=8, seed=11))
    b = backend.sample(ps, 3, SamplingParams(max_tokens=8, seed=11))
    c = backend.sample(ps, 3, SamplingParams(max_tokens=8, seed=12))
    assert torch.equal(before, torch.get_rng_state())
    tokens = [[x.tokens for x in g] for g in a]
    assert tokens == [[x.tokens for x in g] for g in b]
    assert tokens != [[x.tokens for x in g] for g in c]


def test_per_prompt_seeds_make_draws_independent_of_the_batch(model, backend):
    """retrain serve batches separate requests: each prompt's draws must be its own."""
    ps = prompts(model)
    params = SamplingParams(max_tokens=8, seed=99)
    together = backend.sample(ps, 3, replace(params, prompt_seeds=(5, 6, 7)))
    alone = [backend.sample([p], 3, replace(params, prompt_seeds=(s,)))[0]
             for p, s in zip(ps, [5, 6, 7], strict=True)]
    swapped = backend.sample([ps[2], ps[0]], 3, replace(params, prompt_seeds=(7, 5)))
    assert _tokens(together) == _tokens(alone)
    assert _tokens(swapped) == _tokens([alone[2], alone[0]])
    other = backend.sample(ps, 3, replace(params, prompt_seeds=(5, 8, 7)))
    assert _tokens(other)[1] != _tokens(together)[1] and _tokens(other)[0] == _tokens(together)[0]


def test_greedy_is_argmax_and_independent_of_batch_padding(model, backend):
    ps = prompts(model)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    together = backend.sample(ps, 2, greedy)
    alone = backend.sample([ps[0]], 1, greedy)
    assert together[0][0].tokens == together[0][1].tokens == alone[0][0].tokens
    ids = torch.tensor([ps[0]])
    logits = model.net(input_ids=ids).logits[0, -1]
    assert alone[0][0].tokens[0] == int(logits.argmax())


def test_sampling_past_the_models_context_is_refused_before_any_compute(model, backend):
    assert model.max_context == 1024  # the tiny model's position table
    short = prompts(model)[:1]
    with pytest.raises(BackendError, match=r"sampling: prompt 0: prompt \(\d+ tokens\) \+ "
                       r"max_tokens \(1000000000\) exceeds the model's context of 1024"):
        backend.sample(short, 1, SamplingParams(max_tokens=10**9, temperature=0.0))
    with pytest.raises(BackendError, match="prompt 1: prompt .1030 tokens."):
        backend.sample([short[0], [5] * 1030], 1, SamplingParams(max_tokens=1))
    done = backend.sample([[5] * 1020], 1, SamplingParams(max_tokens=4, temperature=0.0))
    assert len(done[0][0].tokens) <= 4  # exactly at the context is fine


def test_micro_batches_do_not_change_the_gradient(model, backend, eos_bias):
    ps = prompts(model)
    datums = datums_for(ps, backend.sample(ps, 4, SamplingParams(max_tokens=10, seed=5)))
    grads = []
    for size in (0, 1, 5):
        backend.micro_batch_size = size
        out = backend.forward_backward(datums, LossConfig())
        grads.append((out.loss, [p.grad.clone() for p in backend.params.values()]))
        backend._zero_grad()
    for loss, g in grads[1:]:
        assert loss == pytest.approx(grads[0][0], abs=1e-6)
        for a, b in zip(g, grads[0][1], strict=True):
            assert torch.allclose(a, b, atol=1e-6)


def test_plan_shares_prompts_and_respects_the_size():
    from retrain.backends.base import Completion

    def d(prompt, n):
        return make_datum(prompt, Completion([5] * n, [-1.0] * n, "length"), 1.0)

    ds = [d([1, 2, 3], 4), d([1, 2, 3], 1), d([7, 8], 3), d([1, 2, 3], 2), d([9], 2)]
    units = plan(ds, 2, cpu_budget(), vocab_size=10)
    assert [u.index for u in units] == [[1, 3], [0, 2], [4]]  # prompt-mates together
    auto = plan(ds, 0, cpu_budget(), vocab_size=10)
    assert sorted(i for u in auto for i in u.index) == [0, 1, 2, 3, 4]


def test_gradient_equals_a_plain_full_sequence_reference(model, backend, eos_bias):
    """Prefix sharing and LM-head slicing are exact: compare with the textbook computation."""
    ps = prompts(model)
    temperature = 0.8
    groups = backend.sample(ps, 3, SamplingParams(max_tokens=10, temperature=temperature, seed=4))
    datums = datums_for(ps, groups, adv=lambda i, j: 0.5 * (j - 1) + 0.1 * i)
    out = backend.forward_backward(datums, LossConfig(temperature=temperature))
    ours = [p.grad.clone() for p in backend.params.values()]
    backend._zero_grad()
    total = sum(sum(d.mask) for d in datums)
    reference = 0.0
    for d in datums:
        logits = model.net(input_ids=torch.tensor([d.input_tokens])).logits[0].float()
        lp = torch.log_softmax(logits / temperature, -1)
        lp = lp.gather(-1, torch.tensor(d.target_tokens)[:, None]).squeeze(-1)
        ratio = torch.exp(lp - torch.tensor(d.logprobs))
        term = (-ratio * torch.tensor(d.advantages) * torch.tensor(d.mask)).sum() / total
        term.backward()
        reference += float(term.detach())
    assert out.loss == pytest.approx(reference, abs=1e-6)
    for a, p in zip(ours, backend.params.values(), strict=True):
        assert torch.allclose(a, p.grad, atol=1e-6, rtol=1e-4)
    backend._zero_grad()


def test_policy_losses():
    new = torch.tensor([0.0, 0.5, -0.5])
    old = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -1.0])
    ratio = torch.exp(new)
    is_loss = token_losses(new, old, adv, LossConfig("importance_sampling")).loss
    assert torch.allclose(is_loss, -ratio * adv)
    ppo = token_losses(new, old, adv, LossConfig("ppo", clip_eps=0.1, clip_eps_high=0.2)).loss
    # ratio e^0.5 with A>0 is clipped at 1.2; ratio e^-0.5 with A<0 is clipped at 0.9
    assert torch.allclose(ppo, torch.tensor([-1.0, -1.2, 0.9]))


def test_optim_step_trains_only_the_adapter(model, backend, eos_bias):
    ps = prompts(model)
    base_before = {k: v.clone() for k, v in model.base.named_parameters() if "lora_" not in k}
    lora_before = {k: v.clone() for k, v in backend.params.items()}
    params = SamplingParams(max_tokens=10, seed=9)
    datums = datums_for(ps, backend.sample(ps, 4, params))
    backend.forward_backward(datums, LossConfig())
    out = backend.optim_step(AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))
    assert out.grad_norm > 0 and out.metrics["skipped"] == 0.0
    assert all(p.grad is None for p in backend.params.values())
    for k, v in model.base.named_parameters():
        if "lora_" not in k:
            assert torch.equal(v, base_before[k]), k
    assert any(not torch.equal(v, lora_before[k]) for k, v in backend.params.items())
    after = backend.forward_backward(datums, LossConfig())
    assert max_logprob_diff(datums, after) > 1e-4  # the policy moved
    backend._zero_grad()


def test_lora_init_is_deterministic_per_seed(model):
    a = LocalBackend.new_adapter(model, "seed_a", lora_rank=4, seed=3)
    b = LocalBackend.new_adapter(model, "seed_b", lora_rank=4, seed=3)
    c = LocalBackend.new_adapter(model, "seed_c", lora_rank=4, seed=4)
    try:
        va, vb, vc = ([p.detach() for p in x.params.values()] for x in (a, b, c))
        assert all(torch.equal(x, y) for x, y in zip(va, vb, strict=True))
        assert not all(torch.equal(x, y) for x, y in zip(va, vc, strict=True))
    finally:
        for name in ("seed_a", "seed_b", "seed_c"):
            model.delete_adapter(name)


def _train_step(backend, ps, seed):
    datums = datums_for(ps, backend.sample(ps, 4, SamplingParams(max_tokens=8, seed=seed)))
    out = backend.forward_backward(datums, LossConfig())
    backend.optim_step(AdamParams(learning_rate=1e-2))
    return out.loss


def test_save_and_load_state_resume_exactly(model, backend, tmp_path):
    ps = prompts(model)
    _train_step(backend, ps, 1)
    ref = backend.save_state("step-1")
    expected = [_train_step(backend, ps, s) for s in (2, 3)]
    weights = {k: v.clone() for k, v in backend.params.items()}
    backend.load_state(ref)
    assert [_train_step(backend, ps, s) for s in (2, 3)] == expected
    for k, v in backend.params.items():
        assert torch.equal(v, weights[k])
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp folders left


def test_checkpoint_is_a_plain_peft_adapter(model, backend, tiny_model):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ps = prompts(model)
    _train_step(backend, ps, 1)
    ref = backend.save_state("final")
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(fresh, ref)
    ids = torch.tensor([ps[1]])
    model.activate(backend.adapter)
    with torch.no_grad():
        ours = model.net(input_ids=ids).logits
        theirs = loaded(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_adapters_on_one_model_are_independent_and_snapshots_frozen(model, backend):
    other = LocalBackend.new_adapter(model, "other", lora_rank=4, seed=7)
    try:
        ps = prompts(model)
        params = SamplingParams(max_tokens=8, seed=21)
        before = other.sample(ps, 2, params)
        snap = backend.snapshot()
        from_snap = backend.sample(ps, 2, params, adapter=snap)
        for s in (1, 2):
            _train_step(backend, ps, s)
        assert _tokens(other.sample(ps, 2, params)) == _tokens(before)
        assert _tokens(backend.sample(ps, 2, params, adapter=snap)) == _tokens(from_snap)
        assert _tokens(backend.sample(ps, 2, params)) != _tokens(from_snap)
        model.delete_adapter(snap)
    finally:
        model.delete_adapter("other")


def _tokens(groups):
    return [[c.tokens for c in g] for g in groups]


def test_out_of_memory_becomes_typed_error_after_halving(model, backend, monkeypatch):
    ps = prompts(model)
    datums = datums_for(ps, backend.sample(ps, 4, SamplingParams(max_tokens=4, seed=1)))
    sizes = []
    real = LocalBackend._forward_backward

    def fake(self, datums, loss, size, *share):
        sizes.append(size)
        if size == 0 or size > 3:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, datums, loss, size, *share)

    monkeypatch.setattr(LocalBackend, "_forward_backward", fake)
    out = backend.forward_backward(datums, LossConfig())  # auto: halves until it fits
    assert sizes[0] == 0 and sizes[-1] <= 3 and out.loss == out.loss
    backend._zero_grad()
    backend.micro_batch_size = 8  # fixed size: no retry, a typed error
    with pytest.raises(BackendOOMError):
        backend.forward_backward(datums, LossConfig())
    assert all(p.grad is None for p in backend.params.values())


def test_sampling_oom_is_typed(model, backend, monkeypatch):
    import retrain.backends.local.backend as local

    def boom(*a, **k):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: "
                           "can't allocate memory: you tried to allocate 1 bytes")

    monkeypatch.setattr(local, "sample_batch", boom)
    with pytest.raises(BackendOOMError):
        backend.sample(prompts(model), 2, SamplingParams(max_tokens=4))


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bfloat16_only_where_the_cpu_computes_it(monkeypatch, native):
    from retrain.backends.local import device as local
    from retrain.errors import UserError

    monkeypatch.setattr(local, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    dtype, why = local.resolve_dtype("auto", cpu)
    assert dtype == (torch.bfloat16 if native else torch.float32)
    assert ("natively" in why) == native
    dtype, why = local.resolve_dtype("bfloat16", cpu)
    assert dtype == torch.bfloat16 and ("several times slower" in why) != native
    assert local.resolve_dtype("float32", cpu) == (torch.float32, "as configured")
    with pytest.raises(UserError, match="'bf16' is not one of auto, bfloat16"):
        local.resolve_dtype("bf16", cpu)


def test_the_loaded_model_says_what_it_chose(model):
    assert model.summary.startswith(f"{model.name_or_path} on cpu, float32 (as configured), ")
    assert model.summary.endswith(" 1 torch threads")


def test_length_buckets_do_not_change_logprobs_or_gradient(model, backend, eos_bias):
    """One bucket per completion length against one bucket for all: the same numbers."""
    ps = prompts(model)
    groups = backend.sample(ps, 4, SamplingParams(max_tokens=12, temperature=0.9, seed=11))
    assert len({len(c.tokens) for g in groups for c in g}) > 2  # lengths differ: buckets form
    datums = datums_for(ps, groups, adv=lambda i, j: 0.3 * j - 0.4 + 0.1 * i)
    results = []
    for overhead in (0, 10**9):
        backend.bucket_overhead = overhead
        out = backend.forward_backward(datums, LossConfig(name="ppo", temperature=0.9))
        results.append((out, [p.grad.clone() for p in backend.params.values()]))
        backend._zero_grad()
    (many, g_many), (one, g_one) = results
    assert many.loss == pytest.approx(one.loss, abs=1e-6)
    assert max_logprob_diff(datums, many) < 1e-4
    for a, b in zip(many.logprobs, one.logprobs, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    for a, b in zip(g_many, g_one, strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_the_automatic_plan_counts_logits_of_the_loss_carrying_targets_only():
    """Only kept targets reach the LM head (logits_to_keep), so one long completion and three
    short ones are one micro-batch: 1130 x 2**14 logits, not 4 padded rows x 1100 x 2**14
    (past AUTO_LOGITS = 2**26). Targets past the budget still split."""
    from retrain.backends.base import Completion
    from retrain.backends.local.training.plan import AUTO_LOGITS

    vocab = 2**14
    prompt = [1, 2, 3]

    def datum(n):
        return make_datum(prompt, Completion([5] * n, [-1.0] * n, "length"), 1.0)

    mixed = [datum(1100), datum(10), datum(10), datum(10)]
    assert 4 * 1100 * vocab > AUTO_LOGITS >= 1130 * vocab
    assert [u.index for u in plan(mixed, 0, cpu_budget(), vocab)] == [[1, 2, 3, 0]]
    long = [datum(1100)] * 4
    assert len(plan(long, 0, cpu_budget(), vocab)) == 2  # 4400 kept targets: over the logits budget
    # A multi-turn episode: only its sampled tokens carry loss (mask 1), not the env's part.
    episode = datum(1500)
    episode.mask = episode.mask[:2] + [float(j % 10 == 0) for j in range(1500)]
    assert len(plan([episode] * 4, 0, cpu_budget(), vocab)) == 1
