"""The fast sampler's decoding step: one token for every row of a static cache, on the device.

A hand-written forward of Llama-like models (Llama, Qwen2, Qwen3: embedding, RMSNorm, rotary
attention with grouped KV heads, gated MLP; Qwen3's RMSNorm on each query and key head),
calling the model's own modules, so that peft's
LoRA layers run as in training (or `MergedWeights` stands in for them). It exists because
transformers' forward builds its attention mask and cache positions with host-side logic
(and differently from one version to the next); this one reads and writes only fixed
buffers (`sampling.static_cache.StaticState`) and device counters, so a CUDA graph can replay it.

`emit` turns logits into the step's token exactly as the exact sampler does
(`sampling.exact.token_logprobs` and `draw`), with the uniforms from `counter_rng` (drawn for
the whole decode at prefill, `StaticState.u`), and
writes the token and its log-prob into the state's output buffers at the step counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from retrain.backends.base import SamplingParams
from retrain.backends.local.sampling.exact import draw, token_logprobs
from retrain.backends.local.sampling.static_cache import Geometry, StaticState
from retrain.backends.sampler_mode import family_problem


@dataclass
class Arch:
    """The modules of a Llama-like causal LM that the decoding step calls."""

    embed: Any
    layers: list[Any]
    norm: Any
    lm_head: Any
    rotary: Any
    heads: int
    kv_heads: int
    head_dim: int


def unsupported(base: Any) -> str | None:
    """Why `base` (a transformers causal LM) cannot use the fast sampler (None if it can)."""
    cfg = base.config
    problem = family_problem(cfg.model_type, getattr(cfg, "layer_types", None))
    if problem:
        return problem
    inner = getattr(base, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm",
                                                            "rotary_emb")):
        return "an unexpected module layout"
    return None


def arch_of(base: Any) -> Arch:
    cfg, inner = base.config, base.model
    heads = int(cfg.num_attention_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return Arch(embed=inner.embed_tokens, layers=list(inner.layers), norm=inner.norm,
                lm_head=base.get_output_embeddings(), rotary=inner.rotary_emb, heads=heads,
                kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
                head_dim=head_dim)


def geometry(arch: Arch, dtype: torch.dtype, device: torch.device) -> Geometry:
    return Geometry(len(arch.layers), arch.kv_heads, arch.head_dim, dtype, device)


def _plain(module: Any, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _head_norm(attn: Any, name: str, x: torch.Tensor) -> torch.Tensor:
    """Qwen3's RMSNorm over each head's features (`q_norm`, `k_norm`), where it has one."""
    norm = getattr(attn, name, None)
    return x if norm is None else norm(x)


def forward(arch: Arch, st: StaticState, window: int, linear=_plain) -> torch.Tensor:
    """Logits [bucket, vocab] of `st.tok` at positions `st.pos`; its keys and values are
    written at cache column `st.col`, and attention reads the first `window` columns.
    `linear(module, x)` runs a projection (the module itself, or its merged weights)."""
    b, hd = st.bucket, arch.head_dim
    group = arch.heads // arch.kv_heads
    h = arch.embed(st.tok[:, None])                        # [b, 1, hidden]
    cos, sin = arch.rotary(h, st.pos[:, None])             # [b, 1, hd]
    cos, sin = cos[:, None], sin[:, None]
    col = st.col.view(1)
    st.valid.index_fill_(1, col, True)
    mask = st.valid[:, None, None, :window]
    for i, layer in enumerate(arch.layers):
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = _head_norm(attn, "q_norm", linear(attn.q_proj, x).view(b, 1, arch.heads, hd))
        k = _head_norm(attn, "k_norm", linear(attn.k_proj, x).view(b, 1, arch.kv_heads, hd))
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = linear(attn.v_proj, x).view(b, 1, arch.kv_heads, hd).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        st.k[i].index_copy_(2, col, k)
        st.v[i].index_copy_(2, col, v)
        # a query head h reads KV head h // group: the group's queries act as the query
        # length of one KV head, so the cache is read once, never repeated per query head
        o = torch.nn.functional.scaled_dot_product_attention(
            q.reshape(b, arch.kv_heads, group, hd), st.k[i][:, :, :window],
            st.v[i][:, :, :window], attn_mask=mask, scale=attn.scaling)
        h = h + linear(attn.o_proj, o.reshape(b, 1, arch.heads * hd))
        x = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        x = mlp.act_fn(linear(mlp.gate_proj, x)) * linear(mlp.up_proj, x)
        h = h + linear(mlp.down_proj, x)
    return linear(arch.lm_head, arch.norm(h))[:, -1]


def emit(st: StaticState, logits: torch.Tensor, params: SamplingParams) -> None:
    """Draw this step's token for every row from `logits` and record it: the output buffers
    at column `st.step` get the token and its log-prob, and `st.tok` is what is fed next."""
    lp = token_logprobs(logits, params.temperature)
    u = None if params.temperature == 0 else st.u.index_select(1, st.step.view(1))[:, 0]
    tok = draw(lp, params, u)
    at = st.step.view(1)
    st.out_tok.index_copy_(1, at, tok[:, None])
    st.out_lp.index_copy_(1, at, lp.gather(-1, tok[:, None]))
    st.tok.copy_(tok)
    st.step.add_(1)


def step(arch: Arch, st: StaticState, params: SamplingParams, window: int,
         linear=_plain) -> None:
    """One whole decoding step (what a CUDA graph captures): feed the last token, draw the
    next."""
    logits = forward(arch, st, window, linear)
    st.pos.add_(1)
    st.col.add_(1)
    emit(st, logits, params)
