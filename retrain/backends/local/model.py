"""The local backend's base model: a causal LM and its tokenizer loaded once, wrapped by peft
with named LoRA adapters, and the lock that every adapter's operations take."""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from retrain.backends.base import BackendError
from retrain.backends.local import lora
from retrain.backends.local.device import pick_device, resolve_dtype
from retrain.backends.local.sampling.compiled import CompiledDecoder
from retrain.backends.local.sampling.exact import (
    cache_keyword,
    check_max_tokens,
    eos_ids,
    model_context,
)
from retrain.backends.local.threads import CpuThreads, fitted_at_load
from retrain.backends.sampler_mode import exact_window
from retrain.control.stepcost import ModelCost
from retrain.errors import UserError
from retrain.machine.cpu import auto_threads
from retrain.machine.cpu_share import cpu_sample

if TYPE_CHECKING:
    from retrain.config.sections import ModelConfig, TrainingConfig


class LocalModel:
    """A base causal LM + tokenizer loaded once; LoRA adapters are added to it by name."""

    def __init__(self, model: Any, tokenizer: Any, device: torch.device, name_or_path: str):
        self.base = model
        self.peft: Any = None            # the PeftModel, once the first adapter exists
        self.tokenizer = tokenizer
        self.device = device
        self.name_or_path = name_or_path
        self.lock = threading.RLock()
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids))
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.cache_key = cache_keyword(model)  # `cache` or `past_key_values`, by version
        self.max_context = model_context(model.config)
        self.lora_configs: dict[str, Any] = {}
        self._active: str | None = None  # what we last activated; peft's own flag can lag
        self.decoder: CompiledDecoder | None = None  # the sampler's compiled decoding step
        self.fast: Any = None  # the StaticSampler, when [backend] sampler resolves to fast
        self.exact_window = exact_window(device.type)  # the exact sampler's steps per read
        self.summary = f"{name_or_path} on {device.type}"  # what `load` chose, for the run log
        self.cpu_threads: CpuThreads | None = None  # automatic threads on a CPU (threads.py)

    @classmethod
    def load(cls, name_or_path: str, dtype: str = "auto", device: str = "auto",
             threads: int = 0) -> LocalModel:
        """Load weights and tokenizer from a folder or the local Hugging Face cache."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads or auto_threads())
        since = cpu_sample()  # what other processes use while this one loads
        dev = pick_device(device)
        torch_dtype, dtype_note = resolve_dtype(dtype, dev)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype)
        except (OSError, ValueError) as exc:  # missing files, unknown architecture, ...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BackendError(f"cannot load model {name_or_path!r}: {first}") from exc
        model.to(dev)
        model.eval()
        loaded = cls(model, tokenizer, dev, name_or_path)
        loaded.cpu_threads = fitted_at_load(threads, dev.type, since)
        loaded.summary = (f"{name_or_path} on {dev.type}, {str(torch_dtype).removeprefix('torch.')}"
                          f" ({dtype_note}), {threads_note(loaded.cpu_threads)}")
        return loaded

    @classmethod
    def from_config(cls, model: ModelConfig, training: TrainingConfig,
                    config_dir: Path | None = None) -> LocalModel:
        """`[model]` loaded (model.name resolved from `config_dir`), checked against
        training.max_tokens when the run samples; a folder or id that is no model is the
        config's fault."""
        from retrain.backends.models import resolve_model

        path = resolve_model(model.name, config_dir)
        try:
            loaded = cls.load(path, model.dtype, model.device, model.threads)
        except BackendError as exc:
            raise UserError(f"model.name = {model.name!r}: {exc}") from None
        if training.max_steps:  # an SFT run (max_steps = 0) samples nothing
            check_max_tokens(training.max_tokens, loaded.max_context, model.name)
        return loaded

    def cost_model(self) -> ModelCost:
        """Parameter count, weight bytes and KV-cache bytes per token (for the roofline)."""
        params = list(self.net.parameters())
        cfg = self.base.config
        layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
        heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
        kv_heads = int(getattr(cfg, "num_key_value_heads", 0) or heads)
        head_dim = int(getattr(cfg, "head_dim", 0) or
                       (getattr(cfg, "hidden_size", 0) // heads if heads else 0))
        element = params[0].element_size() if params else 4
        total = sum(p.numel() for p in params)
        embed = self.base.get_input_embeddings().weight
        head = self.base.get_output_embeddings().weight
        lookup = embed.numel() + (0 if head.data_ptr() == embed.data_ptr() else head.numel())
        return ModelCost(parameters=total,
                         weight_bytes=sum(p.numel() * p.element_size() for p in params),
                         kv_bytes_per_token=2 * layers * kv_heads * head_dim * element,
                         body_parameters=max(total - lookup, 1), head_parameters=head.numel())

    def compile_decoding(self) -> None:
        """Decode through the compiled forward of `net` from now on ([backend] compile)."""
        self.decoder = CompiledDecoder(self.net)
        self.summary += ", decoding step compiled"

    def use_sampler(self, setting: str) -> None:
        """`[backend] sampler`: exact (sample_batch) or fast (a StaticSampler); see
        sampler_mode. Explicit "fast" on a model it cannot run is the config's error; "auto"
        then stays exact, and the run log's model line says why."""
        from retrain.backends import sampler_mode
        from retrain.backends.local.sampling import fast

        self.fast = None
        if sampler_mode.resolve(setting, self.device.type) != "fast":
            return
        why = fast.unsupported(self.net, self.base)
        if why is None:
            self.fast = fast.StaticSampler(self.base, self.device)
            self.summary += ", fast sampler"
        elif setting == "fast":
            raise UserError(f"backend.sampler = \"fast\" cannot sample {self.name_or_path}: "
                            f"{why}; use sampler = \"exact\"")
        else:
            self.summary += f", exact sampler (auto: the fast sampler cannot run {why})"

    @property
    def net(self) -> Any:
        """The module to call: the peft wrapper once adapters exist."""
        return self.peft if self.peft is not None else self.base

    def add_adapter(self, name: str, lora_config: Any, seed: int) -> None:
        """Add a LoRA adapter `name`, initialised deterministically from `seed`."""
        from peft import get_peft_model

        with self.lock:
            if name in self.lora_configs:
                raise BackendError(f"adapter {name!r} already exists")
            with warnings.catch_warnings():  # peft calls a transformers API deprecated in v5
                warnings.simplefilter("ignore", FutureWarning)
                if self.peft is None:
                    self.peft = get_peft_model(self.base, lora_config, adapter_name=name)
                else:
                    self.peft.add_adapter(name, lora_config)
            self.lora_configs[name] = lora_config
            self._active = None
            lora.init_lora(self.adapter_params(name), seed)

    def delete_adapter(self, name: str) -> None:
        with self.lock:
            self.peft.delete_adapter(name)
            if self.fast is not None:
                self.fast.forget(name)
            del self.lora_configs[name]
            self._active = None

    def activate(self, name: str) -> None:
        """Route forward passes through adapter `name` (and make only it trainable)."""
        if self.peft is not None and self._active != name:
            self.peft.set_adapter(name)
            self._active = name

    def adapter_params(self, name: str) -> dict[str, torch.nn.Parameter]:
        """The adapter's parameters by module name, in a stable order. Under the lock: the
        walk reads every module's parameter dict, which adding or deleting another adapter
        (another session of `retrain serve`) changes."""
        with self.lock:
            out = {k: p for k, p in self.peft.named_parameters()
                   if lora.adapter_of(k) == name}
        return dict(sorted(out.items()))


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids = eos_ids(model, tokenizer)
    if not ids:
        raise BackendError("the tokenizer defines no EOS token; completions could never stop")
    return ids


def threads_note(auto: CpuThreads | None) -> str:
    """The run log's word on torch's threads: how many, and why fewer than the cores."""
    note = f"{torch.get_num_threads()} torch threads"
    if auto is not None and auto.threads < auto.most:
        note += (f" (other processes use {auto.others:.1f} of {auto.cores} cores; "
                 f"checked again every step)")
    return note
