"""[sft]: the supervised stage a run may take before its RL steps, and its [sft.data] table
(the sources of [data] that hold replies to learn: a JSONL file or a Hugging Face dataset,
read by the same loaders). `sft_issues` checks the table key by key (the same `opt`
metadata as the sections) and what involves more than one key.

Pure: no I/O. `sft` is the SftConfig; `training` the TrainingConfig (not imported: sections
imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from retrain.config.schema import (
    MAX_BATCH,
    MAX_STEPS,
    MAX_TOKENS,
    MAX_UPDATES,
    ConfigIssue,
    opt,
    table_issues,
)


@dataclass
class SftDataConfig:
    """[sft.data]: checked by `sft_issues` (a table inside [sft], not a section)."""

    source: str = opt("jsonl", "jsonl: a file of chat lines ({\"messages\": [...]}, the reply "
                      "the last assistant turn) or {\"prompt\", \"answer\"} lines; hf: a "
                      "Hugging Face dataset on this machine", choices=("jsonl", "hf"))
    path: str = opt("", "the file, dataset folder or cached dataset name, relative to the "
                    "config file (never downloaded)")
    split: str = opt("train", "hf: the dataset split")
    prompt_field: str = opt("prompt", "hf: the column holding the prompt text")
    answer_field: str = opt("answer", "hf: the column holding the reply to learn")
    messages_field: str = opt("", "hf: a column of chat messages ([{role, content}, ...]) "
                              "instead of prompt_field")
    shuffle: bool = opt(True, "a seeded shuffle of the conversations each epoch")
    chat_template: bool = opt(True, "render with the tokenizer's chat template")
    instruction: str = opt("", "appended to the last user turn of every conversation")


@dataclass
class SftConfig:
    data: dict = opt({}, "the [sft.data] table: where the conversations come from (source, "
                     "path, split, prompt_field, answer_field, messages_field, shuffle, "
                     "chat_template, instruction; docs/sft.md); empty = no SFT stage",
                     factory=True)
    steps: int = opt(0, "SFT steps before the RL steps (give steps or epochs)", lo=0,
                     hi=MAX_STEPS)
    epochs: int = opt(0, "passes over the conversations instead of steps", lo=0,
                      hi=MAX_UPDATES)
    lr: float = opt(1e-4, "AdamW learning rate of the SFT steps (constant)", lo=0, hi=1,
                    lo_open=True)
    batch_size: int = opt(8, "conversations per SFT step", lo=1, hi=MAX_BATCH)
    max_tokens: int = opt(2048, "longest conversation trained, in tokens (longer ones are "
                          "cut to it)", lo=2, hi=MAX_TOKENS)

    @property
    def enabled(self) -> bool:
        return bool(self.data)


def sft_data_config(sft: SftConfig) -> SftDataConfig:
    """The [sft.data] table as an SftDataConfig (`sft_issues` found it valid)."""
    return SftDataConfig(**sft.data)


def sft_issues(sft: SftConfig, training) -> list[ConfigIssue]:
    """Problems of [sft]: keys of an SFT stage without its data, bad [sft.data] keys, both or
    neither of steps and epochs; and training.max_steps = 0 without an SFT stage."""
    if not sft.enabled:
        return _idle_issues(sft, training)
    issues = _data_issues(sft.data)
    if sft.steps and sft.epochs:
        issues.append(ConfigIssue("sft.epochs", f"give sft.steps ({sft.steps}) or sft.epochs "
                                  f"({sft.epochs}), not both"))
    elif not sft.steps and not sft.epochs:
        issues.append(ConfigIssue("sft.steps", "an SFT stage needs sft.steps = N (steps of "
                                  "sft.batch_size conversations) or sft.epochs = N (passes "
                                  "over the data)"))
    return issues


def _idle_issues(sft: SftConfig, training) -> list[ConfigIssue]:
    issues = []
    default = SftConfig()
    for f in fields(SftConfig):
        if f.name != "data" and getattr(sft, f.name) != getattr(default, f.name):
            issues.append(ConfigIssue(f"sft.{f.name}", "is set but [sft.data] is empty: give "
                                      "the conversations ([sft.data] path = \"chat.jsonl\") "
                                      "or remove it"))
    if training.max_steps == 0:
        issues.append(ConfigIssue("training.max_steps", "is 0 and there is no [sft] stage, "
                                  "so the run would train nothing; set max_steps >= 1 or add "
                                  "[sft] with [sft.data]"))
    return issues


def _data_issues(data: dict) -> list[ConfigIssue]:
    issues = table_issues(SftDataConfig, data, "sft.data")
    if not issues and not data.get("path"):
        source = data.get("source", "jsonl")
        issues.append(ConfigIssue("sft.data.path", f"source {source!r} needs a path: "
                                  + ("a JSONL file of conversations" if source == "jsonl" else
                                     "a dataset folder, a parquet file or a cached dataset "
                                     "name")))
    return issues
