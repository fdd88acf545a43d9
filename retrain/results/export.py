"""`retrain export RUN_DIR OUT`: a checkpoint as a folder other tools load.

Without `--merged`: the peft adapter (weights + adapter_config.json naming the base model)
and the tokenizer, for `peft.AutoPeftModelForCausalLM.from_pretrained(OUT)`. With `--merged`:
the LoRA merged into the base weights in float32, with the tokenizer and generation config,
for `transformers.AutoModelForCausalLM.from_pretrained(OUT)`. Both get a README.md model
card. A full fine-tuning run (`model.finetune = "full"`) has no adapter: its checkpoint is the
whole model, exported as such (in the run's dtype, with the tokenizer), with or without
`--merged`. OUT is written beside itself and renamed into place; the run folder is only read.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from retrain.errors import UserError
from retrain.results import run_checkpoint
from retrain.results.model_card import card

ADAPTER_FILES = run_checkpoint.ADAPTER_FILES


@dataclass(frozen=True)
class ExportReport:
    out: str
    step: int
    base: str
    merged: bool
    full: bool = False


def _check_out(out: Path, run_dir: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} already exists and is not an empty folder; pick a new OUT "
                        "(nothing is overwritten)")
    if out.resolve() == run_dir.resolve() or run_dir.resolve() in out.resolve().parents:
        raise UserError(f"{out} is inside the run folder {run_dir}; export elsewhere (the run "
                        "folder is left as training wrote it)")


def export(run_dir: Path, out: Path, *, step: int | None = None,
           merged: bool = False) -> ExportReport:
    run_dir = run_checkpoint.check_run_dir(run_dir)
    out = Path(out)
    _check_out(out, run_dir)
    cfg = run_checkpoint.run_config(run_dir)
    with run_checkpoint.held(run_dir, step) as ckpt:
        return _export(cfg, ckpt, run_dir, out, merged)


def _export(cfg, ckpt: run_checkpoint.Checkpoint, run_dir: Path, out: Path,
            merged: bool) -> ExportReport:
    from retrain.backends.models import resolve_model

    if ckpt.is_tinker and merged:
        raise UserError(f"--merged: step {ckpt.step} is a tinker checkpoint ({ckpt.ref}); "
                        "export the adapter (without --merged) and merge it with peft")
    base = cfg.model.name if ckpt.is_tinker else resolve_model(cfg.model.name, run_dir)
    full = cfg.model.finetune == "full" and not ckpt.is_tinker
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if ckpt.is_tinker:
            from retrain.results.tinker_export import download

            download(cfg, ckpt, tmp)
        elif full:
            _write_full(ckpt, base, tmp)
        elif merged:
            _write_merged(cfg, ckpt, run_dir, tmp)
        else:
            _write_adapter(ckpt, base, tmp)
        (tmp / "README.md").write_text(card(run_dir, step=ckpt.step, base=base, merged=merged,
                                            max_steps=cfg.training.max_steps, full=full),
                                       encoding="utf-8")
        if out.exists():
            out.rmdir()  # an empty folder (checked above)
        tmp.rename(out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{out}: cannot write the export ({exc.strerror or exc})") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportReport(str(out), ckpt.step, base, merged, full)


def _write_adapter(ckpt: run_checkpoint.Checkpoint, base: str, tmp: Path) -> None:
    from transformers import AutoTokenizer

    for name in ADAPTER_FILES:
        shutil.copy2(ckpt.folder / name, tmp / name)
    cfg_path = tmp / "adapter_config.json"
    adapter_cfg = json.loads(cfg_path.read_text())
    adapter_cfg["base_model_name_or_path"] = base
    cfg_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True) + "\n")
    AutoTokenizer.from_pretrained(base).save_pretrained(str(tmp))


def _write_full(ckpt: run_checkpoint.Checkpoint, base: str, tmp: Path) -> None:
    """A full fine-tuning checkpoint is already a transformers model folder: its files and
    the base model's tokenizer."""
    from transformers import AutoTokenizer

    for name in run_checkpoint.MODEL_FILES + run_checkpoint.OPTIONAL_FILES:
        if (ckpt.folder / name).is_file():
            shutil.copy2(ckpt.folder / name, tmp / name)
    AutoTokenizer.from_pretrained(base).save_pretrained(str(tmp))


def _write_merged(cfg, ckpt: run_checkpoint.Checkpoint, run_dir: Path, tmp: Path) -> None:
    from retrain.results.policy import LocalPolicy

    policy = LocalPolicy.load(cfg, ckpt, run_dir, dtype="float32")
    model = policy.model.merge_and_unload()
    model.save_pretrained(str(tmp))
    policy.tokenizer.save_pretrained(str(tmp))


def show(run_dir: Path, out: Path, *, step: int | None, merged: bool) -> None:
    r = export(run_dir, out, step=step, merged=merged)
    what = ("fully fine-tuned model" if r.full else "merged model (float32)" if r.merged
            else "LoRA adapter")
    print(f"wrote {r.out}: {what} of step {r.step} over {r.base}, with README.md")
