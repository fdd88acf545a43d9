"""[reward.judge]: the judge reward's settings, a table inside [reward] (not a section of its
own). `judge_issues` checks it field by field (the same `opt` metadata as the sections) when a
config is built; `judge_config` gives the typed view the judge runs on.

Pure: no I/O. `reward` is the RewardConfig (not imported: sections imports this module).
"""

from __future__ import annotations

from dataclasses import dataclass

from retrain.config.schema import (
    MAX_STEPS,
    MAX_TOKENS,
    MAX_WAIT_S,
    MAX_WORKERS,
    ConfigIssue,
    opt,
    table_issues,
)


@dataclass
class JudgeConfig:
    """[reward.judge]: checked by `judge_issues` (a table inside [reward], not a section)."""

    base_url: str = opt("", "the judge's OpenAI-compatible URL, e.g. http://host:8000/v1")
    model: str = opt("", "the model name sent to the judge")
    api_key_env: str = opt("", "the environment variable holding the judge's API key (read "
                           "there only, never written); empty = no key")
    rubric: str = opt("", "the judging prompt with {prompt}, {completion} and {answer}; "
                      "empty = the built-in rubric")
    rubric_file: str = opt("", "a file holding the rubric instead, relative to the config file")
    mode: str = opt("pointwise", "pointwise = one request per completion; group = one request "
                    "scores all completions of a prompt against each other",
                    choices=("pointwise", "group"))
    max_concurrent: int = opt(4, "judge requests in flight at once", lo=1, hi=MAX_WORKERS)
    timeout_s: float = opt(60.0, "deadline of one judge request", lo=0, lo_open=True,
                           hi=MAX_WAIT_S)
    retries: int = opt(3, "retries (with backoff) of a request answered 429/5xx or not at all",
                       lo=0, hi=20)
    max_tokens: int = opt(512, "the longest judge reply", lo=1, hi=MAX_TOKENS)
    temperature: float = opt(0.0, "the judge's sampling temperature", lo=0, hi=2)
    max_failed_steps: int = opt(3, "stop the run after this many steps in a row in which "
                                "every judge request failed (no answer after its retries)",
                                lo=1, hi=MAX_STEPS)


def judge_config(reward) -> JudgeConfig:
    """The [reward.judge] table as a JudgeConfig (`judge_issues` found it valid)."""
    return JudgeConfig(**reward.judge)


def judge_issues(reward) -> list[ConfigIssue]:
    """Problems of [reward.judge]: unknown keys, bad values, a judge without URL or model."""
    if reward.type != "judge":
        return [] if not reward.judge else [ConfigIssue(
            "reward.judge", "is for reward.type = 'judge': remove it or set the type")]
    issues = table_issues(JudgeConfig, reward.judge, "reward.judge")
    for key in ("base_url", "model"):
        if not reward.judge.get(key):
            issues.append(ConfigIssue(f"reward.judge.{key}", "reward.type = 'judge' needs "
                                      f"[reward.judge] {key} = ..."))
    url = reward.judge.get("base_url")
    if isinstance(url, str) and url and _url_problem(url):
        issues.append(ConfigIssue("reward.judge.base_url", _url_problem(url)))
    if reward.judge.get("rubric") and reward.judge.get("rubric_file"):
        issues.append(ConfigIssue("reward.judge.rubric_file", "give rubric or rubric_file, "
                                  "not both"))
    return issues


def _url_problem(url: str) -> str | None:
    """Why `url` is no http(s) URL, with the fix. Checked here because the judge's client
    would only say "cannot be reached" (urllib even reads `localhost:8000/v1` as a scheme)."""
    head, sep, rest = url.partition("://")
    if not sep:
        return f"{url!r} has no scheme; write 'http://{url}' (or https://)"
    if head.lower() not in ("http", "https"):
        return f"{url!r}: the judge is reached over http:// or https://; write 'http://{rest}'"
    if not rest.strip("/"):
        return f"{url!r} names no host; write e.g. 'http://localhost:8000/v1'"
    return None
