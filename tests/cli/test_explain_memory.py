"""`retrain explain`'s memory line: the estimate's arithmetic, the parameter counts it reads
from safetensors headers (checked against torch and peft on the tiny model), the line for
full fine-tuning and for LoRA, and the warnings about full fine-tuning."""

from __future__ import annotations

import json

import pytest

from retrain.cli.app import run_app
from retrain.cli.explain import memory as mem


def test_full_keeps_five_copies_and_lora_five_of_the_adapter_only():
    assert mem.full_estimate(1000, 4, reference=False).total == 20_000
    assert mem.full_estimate(1000, 2, reference=True).total == 12_000  # + the base copy
    lora = mem.lora_estimate(1000, 10, 4)
    assert (lora.weights, lora.grads, lora.adam, lora.undo, lora.reference) == \
        (4040, 40, 80, 40, 0)


def test_counts_from_the_headers_equal_torch_and_peft(tiny_model):
    torch = pytest.importorskip("torch")
    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel

    shapes = mem.read_shapes(mem.model_folder("tiny-random", tiny_model))
    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    assert shapes.count() == sum(p.numel() for p in model.base.parameters())  # tied: once
    backend = LocalBackend.new_adapter(model, "count", lora_rank=8)  # peft's default targets
    assert shapes.lora_count([], 8) == sum(p.numel() for p in backend.params.values())
    assert shapes.lora_count(["down_proj"], 2) == sum(
        2 * (m.in_features + m.out_features) for n, m in model.base.named_modules()
        if n.endswith("down_proj") and isinstance(m, torch.nn.Linear))
    assert shapes.lora_count(["nothing"], 8) is None


def test_all_linear_is_every_linear_layer_of_the_decoder_as_peft_makes_it(tiny_model):
    torch = pytest.importorskip("torch")
    from retrain.backends.local.backend import LocalBackend
    from retrain.backends.local.model import LocalModel

    model = LocalModel.load(tiny_model, "float32", "cpu", 1)
    names = sorted({n.rsplit(".", 1)[-1] for n, m in model.base.named_modules()
                    if isinstance(m, torch.nn.Linear) and "lm_head" not in n})
    assert {"q_proj", "v_proj", "down_proj"} <= set(names)
    word = LocalBackend.new_adapter(model, "word", lora_rank=4, target_modules=["all-linear"])
    listed = LocalBackend.new_adapter(model, "listed", lora_rank=4, target_modules=names)
    strip = [n.replace(".word.", ".").replace(".listed.", ".") for n in (*word.params,
                                                                         *listed.params)]
    assert strip[:len(word.params)] == strip[len(word.params):]  # the same layers, same order
    shapes = mem.read_shapes(mem.model_folder("tiny-random", tiny_model))
    assert shapes.lora_count(["all-linear"], 4) == shapes.lora_count(names, 4) == sum(
        p.numel() for p in word.params.values())


def _memory(tmp_path, capsys, text: str) -> str:
    path = tmp_path / "m.toml"
    path.write_text(text)
    assert run_app(["explain", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["settings"]["memory"]


def test_the_line_for_full_fine_tuning_and_for_lora(tiny_model, tmp_path, capsys):
    n = mem.read_shapes(mem.model_folder("tiny-random", tiny_model)).count()
    model = "[model]\nname = 'tiny-random'\ndtype = 'float32'\n"
    full = _memory(tmp_path, capsys, model + "finetune = 'full'\n")
    assert full.startswith(f"full fine-tuning: ~{20 * n / 1024**2:.2f} MiB = weights "
                           f"{4 * n / 1024:.1f} KiB + gradients")
    assert f"({n:,} parameters, float32)" in full and "LoRA rank 8: ~" in full
    assert "an estimate" in full and "base copy" not in full
    kl = _memory(tmp_path, capsys, model + "finetune = 'full'\n[algorithm]\nkl_coef = 0.1\n")
    assert f"~{24 * n / 1024**2:.2f} MiB" in kl and "base copy for the KL term" in kl
    lora = _memory(tmp_path, capsys, model)
    assert lora.startswith("LoRA rank 8: ~") and f"full fine-tuning: ~{20 * n / 1024**2:.2f}" \
        " MiB" in lora


def test_a_model_not_on_this_machine_has_no_estimate(tmp_path, capsys):
    line = _memory(tmp_path, capsys, "[model]\nname = 'org/not-here'\nfinetune = 'full'\n")
    assert line.startswith("full fine-tuning; memory unknown until org/not-here")


@pytest.mark.parametrize("text,fragment", [
    ("finetune = 'full'\ndtype = 'bfloat16'\n", "model.finetune = 'full' in bfloat16"),
    ("finetune = 'full'\ndtype = 'float32'\nlora_rank = 4\n", "model.lora_rank: unused"),
])
def test_full_fine_tuning_warnings(tmp_path, capsys, text, fragment):
    path = tmp_path / "w.toml"
    path.write_text("[model]\nname = 'org/not-here'\n" + text)
    assert run_app(["explain", str(path), "--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert any(fragment in w for w in warnings), warnings
    path.write_text("[model]\nname = 'org/not-here'\ndtype = 'float32'\nfinetune = 'full'\n")
    assert run_app(["explain", str(path), "--json"]) == 0
    assert not any("finetune" in w for w in json.loads(capsys.readouterr().out)["warnings"])
