"""`retrain explain`: the plan, the pilot-based wall-time estimate, and risky-setting warnings."""

from __future__ import annotations

import json
import os
import sys
import types
from dataclasses import dataclass, field

import pytest

from retrain.campaign.plan import CampaignPlan, Condition
from retrain.cli.app import run_app
from retrain.cli.explain import dry_run as explain
from retrain.config import loader as config_file
from retrain.config import sections as config
from retrain.config.sections import Config
from tests.plans import GRPO_VS_RLOO, SINGLE_RUN


@dataclass
class _Spec:
    name: str
    condition: str
    seed: int
    overrides: dict = field(default_factory=dict)


def _fake_expand(cfg: Config, camp: CampaignPlan) -> list[_Spec]:
    seeds = camp.seeds or [cfg.training.seed]
    conds = camp.conditions or [Condition(name="base")]
    return [_Spec(f"{c.name}_s{s}", c.name, s, dict(c.overrides)) for c in conds for s in seeds]


@pytest.fixture
def matrix(monkeypatch):
    """retrain.campaign.matrix (another helper's module) when present, else a stand-in."""
    try:
        import retrain.campaign.matrix as real  # noqa: F401
    except ImportError:
        fake = types.ModuleType("retrain.campaign.matrix")
        fake.expand = _fake_expand
        monkeypatch.setitem(sys.modules, "retrain.campaign.matrix", fake)


def write(tmp_path, text, name="plan.toml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def make_run(folder, cfg: Config, step_times, mtime=None):
    """A finished run folder as the trainer leaves it: resolved config + metrics."""
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(config_file.dumps_config(cfg))
    rows = [json.dumps({"step": i + 1, "step_time_s": t}) for i, t in enumerate(step_times)]
    (folder / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    if mtime is not None:
        os.utime(folder / "metrics.jsonl", (mtime, mtime))



CAMPAIGN = SINGLE_RUN + """
[campaign]
seeds = [1, 2]
parallel = true
max_workers = 2
""" + GRPO_VS_RLOO + """[[campaign.conditions]]
name = "long"
"training.max_steps" = 40
"""


def test_single_run_plan_without_pilot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = explain.build_report(write(tmp_path, SINGLE_RUN))
    assert r.kind == "single run" and r.name == "plan"
    assert r.completions_per_step == 16
    assert [p.name for p in r.runs] == ["plan"] and r.runs[0].folder == os.path.join("logs", "plan")
    assert r.total_steps == 20 and r.effective_parallelism == 1
    assert r.pilot is None and r.wall_time_s is None
    assert r.wall_time == "unknown: run a pilot"


def test_pilot_gives_the_wall_time_and_names_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, SINGLE_RUN)
    cfg = config_file.load_config(path)
    make_run(tmp_path / "logs" / "old-pilot", config.run_config(cfg, **{"training.max_steps": 3}),
             [10.0, 2.0, 4.0], mtime=1000)
    make_run(tmp_path / "logs" / "newer", cfg, [3.0, 5.0], mtime=2000)
    other = config.run_config(cfg, **{"training.batch_size": 4})
    make_run(tmp_path / "logs" / "newest-but-other-batch", other, [99.0], mtime=3000)
    r = explain.build_report(path)
    assert r.pilot.run == os.path.join("logs", "newer")
    assert r.pilot.median_step_time_s == 4.0 and r.pilot.steps == 2
    assert r.wall_time_s == 4.0 * 20 / 1
    lines = "\n".join(explain.plain_lines(r))
    assert "newer" in lines and "~1m 20s" in lines


def test_pilot_inside_a_campaign_folder_is_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, SINGLE_RUN)
    make_run(tmp_path / "logs" / "camp" / "a_s1", config_file.load_config(path), [6.0])
    (tmp_path / "logs" / "camp" / "manifest.json").write_text("{}")
    assert explain.build_report(path).pilot.median_step_time_s == 6.0


def test_pilot_with_torn_metrics_and_broken_config_is_tolerated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, SINGLE_RUN)
    make_run(tmp_path / "logs" / "torn", config_file.load_config(path), [2.0])
    with open(tmp_path / "logs" / "torn" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 2, "step_ti')
    (tmp_path / "logs" / "broken").mkdir()
    (tmp_path / "logs" / "broken" / "config.toml").write_text("[[[")
    (tmp_path / "logs" / "broken" / "metrics.jsonl").write_text('{"step_time_s": 1}\n')
    r = explain.build_report(path)
    assert r.pilot.run.endswith("torn") and r.pilot.median_step_time_s == 2.0


def test_campaign_matrix_steps_and_parallelism(tmp_path, monkeypatch, matrix):
    monkeypatch.chdir(tmp_path)
    r = explain.build_report(write(tmp_path, CAMPAIGN, "camp.toml"))
    assert r.kind == "campaign" and r.name == "camp"
    names = [p.name for p in r.runs]
    assert names == ["grpo_s1", "grpo_s2", "rloo_s1", "rloo_s2", "long_s1", "long_s2"]
    assert r.conditions == ["grpo", "rloo", "long"] and r.seeds == [1, 2]
    assert [p.seed for p in r.runs] == [1, 2] * 3
    assert r.runs[0].folder == os.path.join("logs", "camp", "grpo_s1")
    assert r.total_steps == 4 * 20 + 2 * 40
    assert r.effective_parallelism == 2
    text = "\n".join(explain.plain_lines(r))
    assert "3 conditions x 2 seeds" in text and "rloo_s2" in text
    assert "algorithm.advantage=\"rloo\"" in text


def test_campaign_estimate_uses_parallelism(tmp_path, monkeypatch, matrix):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, CAMPAIGN, "camp.toml")
    base = config_file.load_config(path)
    make_run(tmp_path / "logs" / "pilot", config.run_config(base),  # the campaign's base run
             [3.0, 3.0, 3.0])
    r = explain.build_report(path)
    assert r.wall_time_s == 3.0 * 160 / 2


def test_campaign_named_folder_and_sequential(tmp_path, monkeypatch, matrix):
    monkeypatch.chdir(tmp_path)
    text = CAMPAIGN.replace("parallel = true", "parallel = false\nname = \"sweep\"")
    r = explain.build_report(write(tmp_path, text, "camp.toml"))
    assert r.name == "sweep" and r.effective_parallelism == 1
    assert r.runs[0].folder == os.path.join("logs", "sweep", "grpo_s1")


def test_warnings_for_risky_settings(tmp_path, monkeypatch, matrix):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    r = explain.build_report(write(tmp_path, CAMPAIGN.replace("max_tokens = 1024",
                                                              "max_tokens = 10240"), "c.toml"))
    text = " ".join(r.warnings)
    assert "2 local runs at once share this machine's CPU" in text
    assert "max_tokens = 10240 on a CPU" in text

    risky = write(tmp_path, """
[training]
batch_size = 8
group_size = 1
top_p = 0.9
[backpressure]
enabled = true
max_batch_size = 4
[backend]
backend = "tinker"
""", "risky.toml")
    text = " ".join(explain.build_report(risky).warnings)
    for fragment in ("backpressure.max_batch_size (4) < training.batch_size (8)",
                     "group_size = 1", "training.top_p = 0.9", "TINKER_API_KEY"):
        assert fragment in text


def test_quiet_config_has_no_warnings(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    path = write(tmp_path, SINGLE_RUN + '[data]\nsource = "jsonl"\npath = "d.jsonl"\n'
                           'eval_size = 0\n')
    assert explain.build_report(path).warnings == []


def test_seed_flag_on_a_seeded_campaign_warns(tmp_path, monkeypatch, matrix):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, CAMPAIGN, "c.toml")
    r = explain.build_report(path, {"training.seed": 7})
    assert any("--seed" in w for w in r.warnings)


def test_identical_conditions_warn(tmp_path, monkeypatch, matrix):
    monkeypatch.chdir(tmp_path)
    text = SINGLE_RUN + """
[campaign]
seeds = [1]
[[campaign.conditions]]
name = "a"
"training.lr" = 1e-5
[[campaign.conditions]]
name = "b"
"training.lr" = 1e-5
"""
    r = explain.build_report(write(tmp_path, text, "c.toml"))
    assert any("'a' and 'b' set the same overrides" in w for w in r.warnings)


def test_cli_json_and_plain_output(tmp_path, monkeypatch, capsys, matrix):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, CAMPAIGN, "camp.toml")
    assert run_app(["explain", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kind"] == "campaign" and len(data["runs"]) == 6
    assert data["total_steps"] == 160 and data["effective_parallelism"] == 2
    assert data["wall_time"] == "unknown: run a pilot" and data["pilot"] is None
    assert run_app(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" not in out  # plain text when not a terminal
    assert "16 completions" in out and "total steps" in out and "unknown: run a pilot" in out


def test_rich_output_path(tmp_path, monkeypatch, capsys, matrix):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(explain.render, "stdout_is_terminal", lambda: True)
    path = write(tmp_path, CAMPAIGN, "camp.toml")
    assert run_app(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "grpo_s1" in out and "OK" in out and "warnings" in out


@pytest.mark.parametrize("name", ["quickstart", "experiment", "campaign"])
def test_every_template_explains(tmp_path, monkeypatch, matrix, name):
    from retrain.cli import templates

    monkeypatch.chdir(tmp_path)
    r = explain.build_report(templates.write_template(name))
    assert r.total_steps == sum(p.max_steps for p in r.runs) > 0
    if name == "quickstart":
        assert r.completions_per_step == 32 and r.warnings == []
    if name == "campaign":
        assert len(r.runs) == 6 and r.effective_parallelism == 2


def test_explain_shows_the_environment_and_warns_on_a_small_episode_budget(tmp_path):
    from retrain.cli.explain.dry_run import build_report, plain_lines

    path = tmp_path / "env.toml"
    path.write_text('[environment]\nkind = "guess_number"\nmax_turns = 4\n'
                    'max_episode_tokens = 100\n[training]\nmax_tokens = 64\n')
    report = build_report(path)
    text = "\n".join(plain_lines(report))
    assert "guess_number, up to 4 turns, at most 100 sampled tokens per episode" in text
    assert "episodes = " in text
    assert any("environment.max_turns (4) x training.max_tokens (64) = 256" in w
               for w in report.warnings)
    path.write_text('[environment]\nkind = "guess_number"\nmax_turns = 4\n'
                    '[training]\nmax_tokens = 64\n')
    report = build_report(path)
    assert report.settings["episode_tokens_worst_case"] == 256
    assert not any("max_episode_tokens" in w for w in report.warnings)


def test_backpressure_in_parallel_runs_over_one_api_warns(tmp_path, monkeypatch, matrix):
    """Issue 26: several runs of one parallel campaign with [backpressure] over a shared API
    fight; explain says so and points to max_concurrent = "auto" (not for one run at a time,
    nor for local runs, nor without back-pressure)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TINKER_API_KEY", "x")
    base = SINGLE_RUN + """
[backend]
backend = "tinker"
[backpressure]
enabled = true
[campaign]
seeds = [1, 2, 3, 4]
parallel = true
"""
    r = explain.build_report(write(tmp_path, base, "c.toml"))
    fight = [w for w in r.warnings if "shared API" in w]
    assert fight and f"{r.effective_parallelism} runs at once" in fight[0]
    assert r.effective_parallelism >= 2 and 'max_concurrent = "auto"' in fight[0]
    for quiet in (base.replace("parallel = true", "parallel = false"),
                  base.replace("enabled = true", "enabled = false"),
                  base.replace('backend = "tinker"', 'backend = "local"')):
        r = explain.build_report(write(tmp_path, quiet, "q.toml"))
        assert not any("shared API" in w for w in r.warnings), r.warnings
    one_condition = base.replace("enabled = true", "enabled = false") + """
[[campaign.conditions]]
name = "bp"
"backpressure.enabled" = true
"""
    r = explain.build_report(write(tmp_path, one_condition, "o.toml"))
    assert any("shared API" in w for w in r.warnings)


# ---------------------------------------------------------------------------- the data it reads


def _chat_file(tmp_path, n=8) -> None:
    rows = [{"messages": [{"role": "user", "content": f"{i}+{i}?"},
                          {"role": "assistant", "content": str(2 * i)}]} for i in range(n)]
    (tmp_path / "chat.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")


def test_an_sft_run_is_explained_as_one(tmp_path, monkeypatch, capsys):
    """training.max_steps = 0: no RL task, sampler or loss, the SFT steps counted in the total,
    no warning about a key only RL steps use (max_tokens on a CPU), save_every against the
    run's own steps."""
    monkeypatch.chdir(tmp_path)
    _chat_file(tmp_path)
    path = write(tmp_path, """
[model]
device = "cpu"
[training]
max_steps = 0
max_tokens = 10240
save_every = 5
[sft]
steps = 3
batch_size = 4
[sft.data]
path = "chat.jsonl"
""", "sft.toml")
    assert run_app(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    shown = {line.split()[0] for line in out.splitlines()[1:] if line.startswith("  ")}
    assert {"task", "per", "loss", "sampler", "data"}.isdisjoint(shown), out
    assert "  total steps    3" in out and "0 RL steps after them" in out
    assert "max_tokens = 10240 on a CPU" not in out
    assert "training.save_every (5) > the run's 3 [sft] steps + training.max_steps (0)" in out

    report = explain.build_report(path, {"training.max_steps": 2})  # 3 SFT + 2 RL steps
    assert report.total_steps == 5 and report.runs[0].sft_steps == 3
    assert report.data == "built-in arithmetic: 36 training problems, 64 held out"  # of 100


def test_explain_reads_data_as_the_run_will(tmp_path, monkeypatch, capsys):
    """A missing [data] file, or a parquet without the prompt column, is the run's one-line
    error in explain too (it said OK, then the run failed at start)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    missing = write(tmp_path, SINGLE_RUN + '[data]\nsource = "jsonl"\npath = "gone.jsonl"\n')
    assert run_app(["explain", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: data.path: ") and "gone.jsonl does not exist" in err
    assert "\n" not in err

    pq.write_table(pa.table({"question": [f"{i}+1?" for i in range(4)],
                             "answer": [str(i + 1) for i in range(4)]}), tmp_path / "q.parquet")
    columns = write(tmp_path, SINGLE_RUN + '[data]\nsource = "hf"\npath = "q.parquet"\n'
                                           'eval_size = 1\n', "hf.toml")
    assert run_app(["explain", str(columns)]) == 2
    err = capsys.readouterr().err.strip()
    assert "prompt" in err and "question" in err and "\n" not in err, err
    good = write(tmp_path, SINGLE_RUN + '[data]\nsource = "hf"\npath = "q.parquet"\n'
                                        'prompt_field = "question"\neval_size = 1\n', "ok.toml")
    assert run_app(["explain", str(good)]) == 0
    assert "q.parquet: 3 training problems, 1 held out" in capsys.readouterr().out


def test_a_named_pipe_is_refused_not_read(tmp_path, cli_env, python):
    """A pipe waits for a writer: explain (the run too) refuses it in one line naming it, as
    the config file or as a data file the config names. The timeout turns a hang into a
    failure."""
    import subprocess

    os.mkfifo(tmp_path / "pipe.toml")
    os.mkfifo(tmp_path / "rows.jsonl")
    os.mkfifo(tmp_path / "rows.parquet")
    configs = {
        "pipe.toml": "pipe.toml: is a named pipe, not a regular file",
        write(tmp_path, SINGLE_RUN + '[data]\nsource = "jsonl"\npath = "rows.jsonl"\n',
              "j.toml").name: f"data.path: {tmp_path / 'rows.jsonl'} is a named pipe",
        write(tmp_path, SINGLE_RUN + '[data]\nsource = "hf"\npath = "rows.parquet"\n',
              "h.toml").name: f"{tmp_path / 'rows.parquet'} is a named pipe, not a dataset",
        write(tmp_path, SINGLE_RUN + '[sft]\nsteps = 1\n'
                                     '[sft.data]\npath = "rows.jsonl"\n', "s.toml").name:
            f"sft.data.path: {tmp_path / 'rows.jsonl'} is a named pipe",
    }
    for name, said in configs.items():
        done = subprocess.run([python, "-m", "retrain", "explain", name], cwd=tmp_path,
                              env=cli_env, capture_output=True, text=True, timeout=60)
        err = done.stderr.strip()
        assert done.returncode == 2 and said in err and "\n" not in err, (name, err)


def test_an_sft_config_is_explained_without_transformers(tmp_path, cli_env, python,
                                                         tiny_model):
    """The rows that can never train are counted with the model's tokenizer read by
    light_tokenizer.py: transformers (and torch under it) is never imported by explain."""
    import subprocess

    _chat_file(tmp_path)
    long = {"messages": [{"role": "user", "content": "word " * 300},
                         {"role": "assistant", "content": "4"}]}
    with (tmp_path / "chat.jsonl").open("a") as f:
        f.write(json.dumps(long) + "\n")
    write(tmp_path, SINGLE_RUN.replace('device = "cpu"', 'device = "cpu"\nname = "tiny-random"')
          + '[sft]\nsteps = 2\nmax_tokens = 64\n[sft.data]\npath = "chat.jsonl"\n', "sft.toml")
    script = ("import sys\nfrom retrain.cli.app import run_app\ncode = run_app(['explain', "
              "'sft.toml'])\nprint('exit', code, sorted(m for m in ('transformers', 'torch') "
              "if m in sys.modules))\n")
    done = subprocess.run([python, "-c", script], cwd=tmp_path, env=cli_env,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().endswith("exit 0 []"), done.stdout + done.stderr
    assert "sft.data: 1 of 9 conversations" in done.stdout and "row 9" in done.stdout


def test_the_light_tokenizer_renders_as_transformers_does(tiny_model):
    from pathlib import Path

    from transformers import AutoTokenizer

    from retrain.cli.explain import light_tokenizer
    from retrain.environments.ledger import Renderer

    light = light_tokenizer.load(Path(tiny_model))
    assert light is not None
    real = AutoTokenizer.from_pretrained(tiny_model)
    chats = [[{"role": "user", "content": "What is 2 + 3?"}],
             [{"role": "system", "content": "Be terse. ünï \"quoted\""},
              {"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"},
              {"role": "user", "content": "and 3 + 4?"}]]
    for chat_template in (True, False):
        ours, theirs = Renderer(light, chat_template), Renderer(real, chat_template)
        assert ours.chat == chat_template and ours.closing == theirs.closing
        for messages in chats:
            for generation in (True, False):
                assert ours.render(messages, generation) == theirs.render(messages, generation)
