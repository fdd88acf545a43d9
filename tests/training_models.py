"""What the training-pass tests share: a random model of SmolLM2-135M's shape (its hidden
size, heads, FFN and 49,152-token vocabulary, fewer layers; built in code, no hub), datums
of several prompts and lengths, and one forward_backward run through a chosen layout and
head (training/forward.py, training/logprobs.py)."""

from __future__ import annotations

import torch

from retrain.backends.base import Completion, Datum, LossConfig, make_datum
from retrain.backends.local.backend import LocalBackend
from retrain.backends.local.model import LocalModel
from retrain.backends.local.training import accumulate, plan
from retrain.backends.local.training.forward import Forward
from retrain.backends.local.training.logprobs import CHUNK_ENTRIES, Head
from tests.sampler_helpers import lora_b_off_zero

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
               num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True)


def word_tokenizer(vocab: int):
    """A word-level tokenizer over the model's ids (pad 0, EOS 1): nothing is decoded."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(vocab)}, unk_token="t2"))
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="t0", eos_token="t1",
                                   unk_token="t2")


def smollm2_shaped(layers: int = 2) -> LocalModel:
    """SmolLM2-135M's layer and vocabulary shapes with `layers` layers, random, float32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SMOLLM2, num_hidden_layers=layers, max_position_embeddings=2048,
                      bos_token_id=1, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    net = LlamaForCausalLM(cfg).float().eval()
    return LocalModel(net, word_tokenizer(cfg.vocab_size), torch.device("cpu"), "smollm2-shaped")


def adapter(model: LocalModel, name: str, seed: int = 7) -> LocalBackend:
    """A LoRA adapter on every linear layer whose B is not zero (so it has gradients of its
    own and moves the log-probs)."""
    backend = LocalBackend.new_adapter(model, name, lora_rank=4, lora_alpha=8.0, seed=seed,
                                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                       "gate_proj", "up_proj", "down_proj"])
    return lora_b_off_zero(backend, seed, scale=0.05)


def random_datums(vocab: int, seed: int = 0, lengths=((5, 3, 9, 14), (9, 2, 6), (1, 4, 11)),
                  prompt_lengths=(6, 3, 1)) -> list[Datum]:
    """Groups of completions (of `lengths`) on prompts (of `prompt_lengths`; a one-token
    prompt too), off-policy sampler log-probs, advantages of both signs, reference
    log-probs. Short and long sequences, so that packed rows hold several."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=gen).tolist()

    out = []
    for g, (group, p) in enumerate(zip(lengths, prompt_lengths, strict=True)):
        prompt = ids(p)
        for j, n in enumerate(group):
            lps = (-3.0 + torch.rand(n, generator=gen)).tolist()
            d = make_datum(prompt, Completion(ids(n), lps, "length"),
                           (-1.0) ** j * (0.5 + 0.25 * g))
            d.ref_logprobs = [x - 0.2 * float(torch.rand(1, generator=gen)) for x in d.logprobs]
            out.append(d)
    return out


def run(backend: LocalBackend, datums: list[Datum], loss: LossConfig, layout: str,
        entries: int = CHUNK_ENTRIES, model_forward: bool = False, size: int = 0):
    """One forward_backward through `layout` and the head asked for: (its output, the
    trained parameters' gradients), the gradients then zeroed."""
    model = backend.model
    model.activate(backend.adapter)
    net = model.net
    net.train()
    forward = Forward(Head(net, entries, model_forward=model_forward), layout,
                      model.cache_key, backend._make_cache)
    units = plan.plan(datums, size, plan.cpu_budget(), model.vocab_size,
                      packed=layout == "packed")
    trainee = accumulate.Trainee(list(backend.params.values()), model.pad_id, model.device,
                                 torch.Generator().manual_seed(0))
    out = accumulate.forward_backward(forward, trainee, datums, loss, units)
    grads = [p.grad.detach().clone() for p in backend.params.values()]
    backend._zero_grad()
    return out, grads


def assert_same(got, want, datums: list[Datum]) -> None:
    """Loss and log-probs to 1e-6, relative where above 1 (float32's spacing at 10 is ~1e-6);
    gradients to 1e-6, relative to the largest gradient entry where that is above 1 (the
    tiny model's large weights make gradients of ~10, whose float32 rounding is ~1e-6)."""
    (out, grads), (ref, ref_grads) = got, want
    assert abs(out.loss - ref.loss) <= 1e-6 * max(1.0, abs(ref.loss)), (out.loss, ref.loss)
    for d, a, b in zip(datums, out.logprobs, ref.logprobs, strict=True):
        for x, y, m in zip(a, b, d.mask, strict=True):
            assert m == 0 or abs(x - y) <= 1e-6 * max(1.0, abs(y)), (x, y)
    scale = max([1.0] + [float(b.abs().max()) for b in ref_grads])
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0.0, atol=1e-6 * scale)
