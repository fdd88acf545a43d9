"""A trained checkpoint as something to sample from, loaded without any training code:
the base model (transformers) with the run's LoRA adapter (peft), or a full fine-tuning run's
whole model, on the run's device and dtype, decoded by the local backend's own sampling loop
(the training distribution).

`LocalPolicy` serves local checkpoints; `TinkerPolicy` samples a tinker:// checkpoint through
the SDK (from `retrain.results.tinker_policy`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from retrain.backends.base import Completion, SamplingParams, TokenIds
from retrain.config.sections import Config
from retrain.errors import UserError
from retrain.results.run_checkpoint import Checkpoint


class LocalPolicy:
    """Base model + the checkpoint's adapter (or the checkpoint's whole model), in eval mode."""

    def __init__(self, model: Any, tokenizer: Any, device: Any):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        from retrain.backends.local.sampling.exact import eos_ids, model_context

        self.max_context = model_context(model.config)  # prompt + completion tokens
        self.eos_ids = eos_ids(model, tokenizer)
        if not self.eos_ids:
            raise UserError("the tokenizer defines no EOS token; completions could never stop")
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids))

    @classmethod
    def load(cls, cfg: Config, ckpt: Checkpoint, config_dir: Path,
             dtype: str | None = None) -> LocalPolicy:
        """Load what the run trained on (model.name, dtype, device, threads) plus the adapter
        at `ckpt` (or the whole model there: model.finetune = "full"). `dtype` overrides the
        run's (export merges in float32)."""
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        from retrain.backends.local.device import pick_device, resolve_dtype
        from retrain.backends.local.threads import fitted_at_load
        from retrain.backends.models import resolve_model
        from retrain.machine.cpu import auto_threads
        from retrain.machine.cpu_share import cpu_sample

        hf_logging.disable_progress_bar()
        warnings.filterwarnings("ignore", category=FutureWarning)  # transformers/peft renames
        m = cfg.model
        torch.set_num_threads(m.threads or auto_threads())
        since = cpu_sample()  # what other processes use while this one loads
        path = resolve_model(m.name, config_dir)
        try:
            device = pick_device(m.device)
            torch_dtype, _ = resolve_dtype(dtype or m.dtype, device)
            tokenizer = AutoTokenizer.from_pretrained(path)
            if m.finetune == "full":  # the checkpoint is the whole model
                model = AutoModelForCausalLM.from_pretrained(str(ckpt.folder), dtype=torch_dtype)
                model.to(device)
            else:
                base = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
                base.to(device)
                model = PeftModel.from_pretrained(base, str(ckpt.folder))
        except Exception as exc:  # missing files, a damaged adapter, an absent device
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise UserError(f"cannot load {m.name!r} with the checkpoint {ckpt.ref}: "
                            f"{first}") from None
        model.eval()
        fitted_at_load(m.threads, device.type, since)  # eval beside a training run: no spinning
        return cls(model, tokenizer, device)

    def close(self) -> None:
        """Nothing to release: the weights go with the process."""

    def sample(self, prompts: list[TokenIds], n: int, params: SamplingParams,
               chunk: int = 64) -> list[list[Completion]]:
        """`n` completions per prompt, `chunk` prompts per batched decode (as the trainer's
        eval batches them, so greedy results match it exactly)."""
        import torch
        from transformers import DynamicCache

        from retrain.backends.local.sampling.exact import sample_batch

        generator = torch.Generator(self.device).manual_seed(params.seed or 0)
        out: list[list[Completion]] = []
        for i in range(0, len(prompts), chunk):
            out += sample_batch(self.model, prompts[i:i + chunk], n, params,
                                eos_ids=self.eos_ids, pad_id=self.pad_id, generator=generator,
                                make_cache=lambda: DynamicCache(config=self.model.config),
                                decode=self.tokenizer.decode)
        return out

    def stream(self, prompt: TokenIds, params: SamplingParams) -> Iterator[int]:
        """The tokens of one completion as they are drawn (EOS not included; a stop string's
        last token is)."""
        import torch
        from transformers import DynamicCache

        from retrain.backends.local.sampling.exact import draw, token_logprobs
        from retrain.backends.stop_strings import StopWatch

        generator = torch.Generator(self.device).manual_seed(params.seed or 0)
        watch, tokens = StopWatch(params.stop_strings, self.tokenizer.decode), []
        cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model(input_ids=ids, past_key_values=cache, use_cache=True,
                                logits_to_keep=1).logits[:, -1]
            for _ in range(params.max_tokens):
                tok = draw(token_logprobs(logits, params.temperature), params, generator)
                if int(tok) in self.eos_ids:
                    return
                yield int(tok)
                tokens.append(int(tok))
                if watch and watch.hit(tokens):
                    return
                logits = self.model(input_ids=tok[:, None], past_key_values=cache,
                                    use_cache=True, logits_to_keep=1).logits[:, -1]
