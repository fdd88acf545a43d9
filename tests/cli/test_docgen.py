"""docs/configuration.md is generated from the schema and must be up to date."""

from __future__ import annotations

from retrain.cli import docgen
from retrain.config import loader as config_file


def test_configuration_doc_is_up_to_date():
    assert docgen.DOC_PATH.read_text(encoding="utf-8") == docgen.configuration_markdown(), (
        "docs/configuration.md is out of date: run `python -m retrain.cli.docgen`")


def test_every_key_is_documented_with_its_default():
    text = docgen.configuration_markdown()
    for section, key, _default, _help in config_file.describe_keys():
        assert f"## [{section}]" in text
        assert f"| `{key}` |" in text
    assert "| `max_concurrent` | `4` | >= 1, <= 4096 or `\"auto\"` |" in text
    assert "| `batch_size` | `8` | >= 1, <= 65536 |" in text
    assert "`grpo` \\| `dr_grpo`" in text


def test_a_meaning_keeps_its_own_parentheses_only_the_appended_choices_go():
    text = docgen.configuration_markdown()
    assert "on this machine (hf) |" in text  # data.source's help ends "(hf)"
    assert "what trains: lora = a LoRA adapter (the lora_* keys); full = every weight" in text


def test_readme_links_to_the_reference_instead_of_copying_it():
    readme = (docgen.DOC_PATH.parents[1] / "README.md").read_text(encoding="utf-8")
    assert "](docs/configuration.md)" in readme
    assert "| `max_concurrent` |" not in readme and "### [backpressure]" not in readme


def test_check_mode_detects_a_stale_file(tmp_path, monkeypatch, capsys):
    stale = tmp_path / "configuration.md"
    stale.write_text("old\n", encoding="utf-8")
    monkeypatch.setattr(docgen, "DOC_PATH", stale)
    assert docgen.main(["--check"]) == 1
    assert "configuration.md is out of date" in capsys.readouterr().err
    assert docgen.main([]) == 0
    assert stale.read_text(encoding="utf-8") == docgen.configuration_markdown()
    assert docgen.main(["--check"]) == 0
