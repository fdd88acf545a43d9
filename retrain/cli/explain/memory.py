"""What a local run's training state needs in memory, for `retrain explain`: an estimate from
the parameter count and the weights dtype, never a measurement.

The count comes from the model folder's safetensors headers (shapes only, no weights loaded,
no torch). `model.finetune = "full"` keeps weights, gradients and AdamW's two moments for every
parameter, all in the weights dtype, and copies the weights during each update (to undo a
diverged one): 5 x weights, plus a frozen copy of the weights when the KL term needs the base
model; LoRA keeps the frozen weights plus the same five for the adapter. Activations, the KV
cache and work buffers come on top and are not counted.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

from retrain.config.sections import ALL_LINEAR, Config

GIB = 1024**3
HEADER_LIMIT = 100 * 1024**2  # a safetensors header larger than this is no header
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LLAMA_LIKE_DEFAULT = ("q_proj", "v_proj")  # peft's default LoRA targets for Llama/Qwen/Mistral
NOT_LINEAR = ("embed", "lm_head", "wte", "wpe")  # 2-D weights peft's all-linear leaves out


@dataclass(frozen=True)
class Shapes:
    """A model folder's parameters as its files declare them: name -> shape."""

    tensors: dict[str, tuple[int, ...]]
    tied: bool  # input and output embeddings are one parameter

    def count(self) -> int:
        total = sum(_numel(s) for s in self.tensors.values())
        if self.tied and "lm_head.weight" in self.tensors and any(
                k.endswith("embed_tokens.weight") for k in self.tensors):
            total -= _numel(self.tensors["lm_head.weight"])
        return total

    def lora_count(self, targets: list[str], rank: int) -> int | None:
        """Parameters of a rank-`rank` LoRA on the 2-D weights of `targets` (empty: the
        Llama-like default, where the model has those layers); None when none match."""
        names = list(targets) or list(LLAMA_LIKE_DEFAULT)
        if names == [ALL_LINEAR]:   # every linear layer but the embeddings and the head
            found = [s for k, s in self.tensors.items() if len(s) == 2
                     and not any(x in k for x in NOT_LINEAR)]
        else:
            found = [s for k, s in self.tensors.items() if len(s) == 2 and any(
                k.endswith(f"{t}.weight") for t in names)]
        return sum(rank * (s[0] + s[1]) for s in found) if found else None


@dataclass(frozen=True)
class Estimate:
    """Bytes of the training state (pure arithmetic over counts)."""

    weights: int
    grads: int
    adam: int
    undo: int       # the trained weights copied during each update, to undo a diverged one
    reference: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.adam + self.undo + self.reference


def full_estimate(params: int, element: int, reference: bool) -> Estimate:
    """Every parameter trains: weights, gradients, AdamW's exp_avg and exp_avg_sq and the
    update's undo copy, all in the weights dtype; `reference`: a frozen copy of the weights for
    the KL term."""
    w = params * element
    return Estimate(weights=w, grads=w, adam=2 * w, undo=w, reference=w if reference else 0)


def lora_estimate(params: int, adapter: int, element: int) -> Estimate:
    """The frozen base weights plus the adapter's weights, gradients, AdamW states and undo
    copy (the reference is the base with the adapter disabled: no copy)."""
    a = adapter * element
    return Estimate(weights=params * element + a, grads=a, adam=2 * a, undo=a, reference=0)


def weights_dtype(cfg: Config) -> str:
    """model.dtype as the run would resolve it (a guess without torch for auto: bfloat16 on
    an NVIDIA GPU or a CPU that computes it, else float32)."""
    from retrain.machine.cpu import cpu_has_native_bf16

    m = cfg.model
    if m.dtype != "auto":
        return m.dtype
    device = m.device
    if device == "auto":
        device = "cuda" if Path("/proc/driver/nvidia").exists() else \
            "mps" if sys.platform == "darwin" else "cpu"
    if device == "cuda":
        return "bfloat16"
    return "bfloat16" if device == "cpu" and cpu_has_native_bf16() else "float32"


def trainable_count(cfg: Config, config_dir: Path) -> int | None:
    """Parameters that train (the adapter's, or every one for full fine-tuning); None until
    the model is on this machine or when no LoRA target matches."""
    folder = model_folder(cfg.model.name, config_dir)
    shapes = read_shapes(folder) if folder else None
    if shapes is None:
        return None
    m = cfg.model
    return shapes.count() if m.finetune == "full" else \
        shapes.lora_count(m.lora_target_modules, m.lora_rank)


def memory_line(cfg: Config, config_dir: Path) -> str:
    """The explain line: the configured mode's estimate, compared with the other mode's."""
    m = cfg.model
    mode = "full fine-tuning" if m.finetune == "full" else f"LoRA rank {m.lora_rank}"
    folder = model_folder(m.name, config_dir)
    shapes = read_shapes(folder) if folder else None
    if shapes is None:
        return (f"{mode}; memory unknown until {m.name} is on this machine (the first run "
                "fetches or converts it)")
    dtype = weights_dtype(cfg)
    element, params = DTYPE_BYTES[dtype], shapes.count()
    adapter = shapes.lora_count(m.lora_target_modules, m.lora_rank)
    full = full_estimate(params, element, cfg.algorithm.kl_coef > 0)
    lora = lora_estimate(params, adapter, element) if adapter is not None else None
    lora_text = (f"~{size_text(lora.total)} ({_count(adapter)} adapter parameters)"
                 if lora else "unknown (no target modules matched)")
    if m.finetune == "full":
        ref = f" + base copy for the KL term {size_text(full.reference)}" if full.reference else ""
        head = (f"full fine-tuning: ~{size_text(full.total)} = weights {size_text(full.weights)} + "
                f"gradients {size_text(full.grads)} + AdamW states {size_text(full.adam)} + the "
                f"update's undo copy {size_text(full.undo)}{ref} "
                f"({_count(params)} parameters, {dtype}); LoRA rank {m.lora_rank}: "
                f"{lora_text}; each checkpoint ~{size_text(full.weights + full.adam)} on disk")
    else:
        head = (f"LoRA rank {m.lora_rank}: {lora_text} for the weights ({_count(params)} "
                f"parameters, {dtype}) and the adapter's gradients, AdamW states and undo "
                f"copy; full fine-tuning: ~{size_text(full.total)}")
    return head + "; an estimate: activations and the KV cache come on top"


def size_text(n: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1024:.1f} KiB"


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 100_000 else f"{n:,}"


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------- the folder


def model_folder(name: str, config_dir: Path) -> Path | None:
    """The folder holding `name`'s weights, if it is on this machine already: a built-in
    already built, a local folder, or a hub id in the Hugging Face cache. Never builds."""
    from retrain.backends.models import builtin_names, cache_dir

    if name in builtin_names():
        folder = cache_dir() / name
        return folder if (folder / ".complete").exists() else None
    for base in (config_dir, Path.cwd()):
        candidate = (base / name).expanduser()
        if candidate.is_dir():
            return candidate
    if name.count("/") != 1 or name.startswith((".", "/", "~")):
        return None
    hub = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME") or
               Path.home() / ".cache" / "huggingface") / "hub")
    snapshots = hub / f"models--{name.replace('/', '--')}" / "snapshots"
    found = sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return found[-1].parent if found else None


def model_family(name: str, config_dir: Path) -> tuple[str | None, list[str] | None]:
    """`model_type` and `layer_types` from the model folder's config.json, if the model is
    on this machine already ((None, None) otherwise)."""
    folder = model_folder(name, config_dir)
    try:
        cfg = json.loads((folder / "config.json").read_text(encoding="utf-8")) if folder \
            else {}
    except (OSError, ValueError):
        cfg = {}
    kind, layers = cfg.get("model_type"), cfg.get("layer_types")
    return (kind if isinstance(kind, str) else None,
            layers if isinstance(layers, list) else None)


def read_shapes(folder: Path) -> Shapes | None:
    """Every tensor's shape from the folder's safetensors headers; None when it has none or
    one is unreadable."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    tensors: dict[str, tuple[int, ...]] = {}
    try:
        for file in files:
            with open(file, "rb") as fh:
                (size,) = struct.unpack("<Q", fh.read(8))
                if size > HEADER_LIMIT:
                    return None
                header = json.loads(fh.read(size))
            tensors |= {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return Shapes(tensors, tied=bool(config.get("tie_word_embeddings", False)))


# ---------------------------------------------------------------------------- warnings


def finetune_warnings(cfg: Config) -> list[str]:
    """Full fine-tuning settings that are legal but likely to hurt."""
    m = cfg.model
    if m.finetune != "full" or cfg.backend.backend != "local":
        return []
    out = []
    dtype = weights_dtype(cfg)
    if dtype != "float32":
        out.append(f"model.finetune = 'full' in {dtype}: weights and AdamW states are kept in "
                   f"{dtype}, where an update smaller than about 1/256 of a weight rounds "
                   "away; model.dtype = 'float32' is the safe choice for full fine-tuning")
    default = type(m)()
    unused = [f"model.{k}" for k in ("lora_rank", "lora_alpha", "lora_dropout",
                                     "lora_target_modules")
              if getattr(m, k) != getattr(default, k)]
    if unused:
        out.append(f"{', '.join(unused)}: unused with model.finetune = 'full' (no adapter)")
    return out
