"""Config: defaults promised by the docs, every bad-config path through the real CLI, `--set`
typing, and property tests that dump -> load round-trips every section."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from retrain.campaign.plan import FILE_SECTIONS, CampaignPlan, Condition
from retrain.cli.app import run_app
from retrain.config import loader as config_file
from retrain.config import overrides, toml_io
from retrain.config import sections as config
from retrain.config.cross_checks import cross_checks, run_name_problem
from retrain.config.schema import fields_of, hints_of
from retrain.config.sections import Config, ConfigError
from tests import warm

# ---------------------------------------------------------------------------- helpers


def cli(args: list[str], capsys) -> tuple[int, str]:
    """Run the CLI in-process; return (exit status, stdout + stderr)."""
    code = run_app(args)
    out = capsys.readouterr()
    return code, out.out + out.err


def write(tmp_path, text: str | bytes, name: str = "bad.toml"):
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------- defaults


def test_seed_document_defaults():
    cfg = Config()
    bp = cfg.backpressure
    assert (bp.enabled, bp.warmup_steps, bp.ema_decay, bp.throttle_margin, bp.increase_margin,
            bp.min_batch_size, bp.max_batch_size, bp.peak_gflops, bp.peak_bw_gb_s) == (
        False, 10, 0.9, 0.85, 0.5, 1, 64, 0.0, 0.0)
    t = cfg.training
    assert (t.batch_size, t.group_size, t.max_tokens) == (8, 16, 10240)
    assert cfg.backend.max_concurrent == 4 and cfg.backend.backend == "local"
    assert {"parallel", "max_workers", "stagger_seconds"} <= set(fields_of(CampaignPlan))
    assert not CampaignPlan().is_campaign and not hasattr(cfg, "campaign")


def test_seed_document_backpressure_block_parses():
    text = """
[backpressure]
enabled = true
warmup_steps = 10
ema_decay = 0.9
throttle_margin = 0.85
increase_margin = 0.5
min_batch_size = 1
max_batch_size = 64
peak_gflops = 0.0 # optional: hardware peak for roofline hints
peak_bw_gb_s = 0.0 # optional: memory bandwidth for roofline hints

[campaign]
parallel = true
max_workers = 12 # 12 subprocesses run in parallel

[backend]
backend = "tinker"
max_concurrent = 4 # but only 4 hit the Tinker API at once
"""
    cfg, plan = config_file.parse(toml_io.loads(text))
    assert cfg.backpressure.enabled and plan.max_workers == 12
    assert cfg.backend.backend == "tinker"


def test_describe_keys_covers_every_field():
    rows = config_file.describe_keys()
    names = {(s, k) for s, k, _, _ in rows}
    for section, cls in FILE_SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert (section, f.name) in names
    assert all(help_text for *_, help_text in rows)


# ---------------------------------------------------------------------------- bad configs

# (file content, fragments the message must contain). Each goes through `retrain explain`.
BAD_CONFIGS = [
    ("[trainig]\nbatch_size = 2\n", ["[trainig]", "unknown section", "did you mean 'training'"]),
    ("[training]\nbatch_sise = 2\n", ["training.batch_sise", "did you mean 'training.batch_size'"]),
    ("[training]\nadvantage = 'rloo'\n", ["training.advantage", "algorithm.advantage"]),
    ("batch_size = 4\n", ["batch_size", "top-level", "training.batch_size"]),
    ("[model]\nnmae = 'x'\n", ["model.nmae", "did you mean 'model.name'"]),
    ("[training]\nbatch_size = 'eight'\n", ["training.batch_size", "expected an integer",
                                            '"eight"']),
    ("[training]\nbatch_size = 2.5\n", ["training.batch_size", "expected an integer", "2.5"]),
    ("[training]\nbatch_size = 0\n", ["training.batch_size", "must be >= 1", "got 0"]),
    ("[training]\nlr = -1e-4\n", ["training.lr", "must be > 0"]),
    ("[training]\nlr = 'fast'\n", ["training.lr", "expected a number"]),
    ("[training]\nlr = nan\n", ["training.lr", "finite"]),
    ("[training]\ntop_p = 1.5\n", ["training.top_p", "must be <= 1", "1.5"]),
    ("[training]\nmax_steps = 99999999999999999999\n", ["training.max_steps", "out of range"]),
    ("[backpressure]\nenabled = 'yes'\n", ["backpressure.enabled", "expected true or false"]),
    ("[backpressure]\nmin_batch_size = 8\nmax_batch_size = 4\n",
     ["backpressure.min_batch_size", "backpressure.max_batch_size"]),
    ("[algorithm]\nadvantage = 'gpro'\n", ["algorithm.advantage", '"gpro" is not allowed',
                                           "did you mean 'grpo'"]),
    ("[backend]\nbackend = 'tinkr'\n", ["backend.backend", "did you mean 'tinker'"]),
    ("[backend]\nmax_concurrent = 0\n", ["backend.max_concurrent", "must be >= 1"]),
    ("[backend]\nmax_concurrent = 'fast'\n", ["backend.max_concurrent",
                                             'expected an integer or "auto"', '"fast"']),
    ("[backend]\nmax_concurrent = true\n", ["backend.max_concurrent",
                                           'expected an integer or "auto"']),
    ("[backend]\nmax_concurrent = 2.5\n", ["backend.max_concurrent", "2.5"]),
    ("[backend]\nmax_concurrent_min = 8\nmax_concurrent_max = 4\n",
     ["backend.max_concurrent_min", "backend.max_concurrent_max"]),
    ("[data]\nsource = 'jsonl'\n", ["data.path", "data.source = 'jsonl' needs"]),
    ("[data]\nsource = 'hf'\n", ["data.path", "data.source = 'hf' needs"]),
    ("[data]\noperations = ['+', '/']\n", ["data.operations", "'+', '-', '*'"]),
    ("[data]\noperations = '+'\n", ["data.operations", "expected a list of strings"]),
    ("[reward]\ntype = 'custom'\n", ["reward.function", "module:function"]),
    ("[reward]\ntype = 'format'\npattern = '(unclosed'\n", ["reward.pattern", "not a valid regex"]),
    ("[reward]\nparams = 3\n", ["reward.params", "expected a table"]),
    ("training = 5\n", ["training", "must be a table"]),
    ("[campaign]\nseeds = [1, 1]\n", ["campaign.seeds", "unique"]),
    ("[campaign]\nseeds = [1, 'two']\n", ["campaign.seeds", "expected a list of integers"]),
    ("[campaign]\nseeds = [-1]\n", ["campaign.seeds", ">= 0"]),
    ("[campaign]\nmax_workers = -2\n", ["campaign.max_workers", "must be >= 0"]),
    ("[campaign.conditions]\nname = 'a'\n", ["campaign.conditions", "[[campaign.conditions]]"]),
    ("[[campaign.conditions]]\nname = 'a'\n\"training.lrr\" = 1e-4\n",
     ["campaign.conditions[0]", "training.lrr", "did you mean 'training.lr'"]),
    ("[[campaign.conditions]]\nname = 'a'\n\"algorithm.advantage\" = 'nope'\n",
     ["campaign.conditions[0]", "algorithm.advantage", '"nope" is not allowed']),
    ("[[campaign.conditions]]\nname = 'a'\n[[campaign.conditions]]\nname = 'a'\n",
     ["campaign.conditions", "unique", "a"]),
    ("[[campaign.conditions]]\nname = 'a'\n\"campaign.seeds\" = [1]\n",
     ["campaign.seeds", "cannot be overridden per run"]),
    ("[campaign.grid]\n\"training.lr\" = []\n", ["campaign.grid", "non-empty list"]),
    ("[campaign.grid]\n\"training.batch_size\" = [1, 'x']\n",
     ["campaign.grid", "training.batch_size", "expected an integer"]),
    ("[logging]\nlog_dir = 5\n", ["logging.log_dir", "expected a string"]),
    ("[training\nbatch_size = 2\n", [":1:", "invalid TOML"]),
    ("[training]\nbatch_size = = 2\n", [":2:14", "invalid TOML"]),
    ("[training]\nbatch_size = [1,\n", [":2:", "invalid TOML", "end of the file"]),
    ("[training]\nlr = 1\nlr = 2\n", ["invalid TOML"]),
    ("\n  \n\t\n", ["is empty", "retrain init"]),
    (b"\x00\x01\x02\xff binary", ["binary file"]),
    (b"\xff\xfe[training]\n", ["not UTF-8"]),
    (b"\xef\xbb\xbf[training]\nbatch_size = 2\n", ["starts with a byte-order mark",
                                                  "save the file as UTF-8 without BOM"]),
    ("[model]\nname = " + "[" * 330 + "]" * 330 + "\n", ["nested deeper than 64 levels"]),
    ("x = " + "{a = " * 100_000 + "1" + "}" * 100_000 + "\n", ["nested deeper than 64 levels"]),
    ("[model]\nname = ''\n", ["model.name", "is empty"]),
    ("[model]\nname = '  '\n", ["model.name", "is empty"]),
    ('[logging]\nrun_name = "a\\nb"\n', ["logging.run_name", "control character ('\\n')"]),
    ('[logging]\nrun_name = "red\\u001b[31m"\n', ["logging.run_name", "control character"]),
]


@pytest.mark.parametrize("text,fragments", BAD_CONFIGS,
                         ids=[f"bad{i:02d}" for i in range(len(BAD_CONFIGS))])
def test_bad_config_through_cli(tmp_path, capsys, monkeypatch, text, fragments):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, text)
    code, out = cli(["explain", str(path)], capsys)
    assert code == 2, out
    assert "Traceback" not in out
    assert str(path) in out
    for fragment in fragments:
        assert fragment in out, f"{fragment!r} not in {out!r}"


def test_the_bom_advice_does_not_say_to_quote_a_key(tmp_path, capsys):
    path = write(tmp_path, b"\xef\xbb\xbf# a comment\n[training]\nbatch_size = 2\n")
    code, out = cli(["explain", str(path)], capsys)
    assert code == 2 and "byte-order mark" in out and "quote" not in out
    assert len(out.strip().splitlines()) == 1


def test_an_empty_model_name_never_resolves_to_a_folder(tmp_path):
    from retrain.backends.models import resolve_model
    from retrain.errors import UserError

    with pytest.raises(UserError, match="model.name is empty"):
        resolve_model("", tmp_path)


def test_at_least_25_bad_configs():
    assert len(BAD_CONFIGS) >= 25


def test_missing_file_directory_and_unreadable(tmp_path, capsys):
    code, out = cli(["explain", str(tmp_path / "nope.toml")], capsys)
    assert code == 2 and "no such file" in out and "nope.toml" in out
    assert len(out.strip().splitlines()) == 1
    code, out = cli(["explain", str(tmp_path)], capsys)
    assert code == 2 and "is a directory" in out and len(out.strip().splitlines()) == 1
    for content, words in ((b"", "is empty"), (b"\x00\x89PNG\r\n", "binary file"),
                           (b"\xc3\x28 = 1", "not UTF-8")):
        path = write(tmp_path, content, "odd.toml")
        code, out = cli(["explain", str(path)], capsys)
        assert code == 2 and words in out and len(out.strip().splitlines()) == 1, out


def test_every_problem_reported_at_once(tmp_path, capsys):
    path = write(tmp_path, "[training]\nbatch_size = 0\nlr = 'x'\n[modle]\n")
    code, out = cli(["explain", str(path)], capsys)
    assert code == 2
    assert "3 problems" in out
    for fragment in ("training.batch_size", "training.lr", "[modle]"):
        assert fragment in out


@pytest.mark.parametrize("content,fragment", [
    ("[training]\nbatch_sise = 2\n", "did you mean 'training.batch_size'"),
    ("[training\n", "invalid TOML"),
])
def test_bad_config_real_subprocess(tmp_path, cli_env, content, fragment):
    path = write(tmp_path, content)
    proc = warm.run([sys.executable, "-m", "retrain", "explain", str(path)],
                    capture_output=True, text=True, env=cli_env, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    assert fragment in proc.stderr and proc.stderr.startswith("error: ")


# ---------------------------------------------------------------------------- --set and shortcuts


def test_set_values_are_typed_by_the_schema():
    got = overrides.parse_set_args([
        "training.lr=1e-4", "training.batch_size=4", "backpressure.enabled=true",
        "data.operations=['+', '-']", "model.name=my-model", 'logging.run_name="quoted"',
        "backend.options.region=eu", "backend.options.retries=3", "reward.params={k = 1}",
        "campaign.parallel=true", "model.name=123", "backend.max_concurrent=auto"])
    assert got["training.lr"] == 1e-4 and isinstance(got["training.lr"], float)
    assert got["training.batch_size"] == 4
    assert got["backpressure.enabled"] is True
    assert got["data.operations"] == ["+", "-"]
    assert got["model.name"] == "123"  # string keys keep the text, even if it looks numeric
    assert got["logging.run_name"] == "quoted"
    assert got["backend.options.region"] == "eu" and got["backend.options.retries"] == 3
    assert got["reward.params"] == {"k": 1}
    assert got["campaign.parallel"] is True
    assert got["backend.max_concurrent"] == "auto"
    assert overrides.parse_set_args(["backend.max_concurrent=8"])["backend.max_concurrent"] == 8


@pytest.mark.parametrize("item,fragments", [
    ("training.lr=fast", ["--set", "training.lr", "expected a number"]),
    ("training.batch_size=0", ["training.batch_size", "must be >= 1"]),
    ("training.batchsize=4", ["did you mean 'training.batch_size'"]),
    ("trainig.lr=1", ["unknown section", "did you mean 'training'"]),
    ("training.lr", ["expected section.key=value"]),
    ("lr=1", ["not a 'section.key' name"]),
    ("algorithm.advantage=gpro", ["did you mean 'grpo'"]),
    ("campaign.conditions=[]", ["in the TOML file"]),
    ("training.lr.x=1", ["not a table"]),
])
def test_bad_set_through_cli(tmp_path, capsys, item, fragments):
    path = write(tmp_path, "[training]\nmax_steps = 3\n", "ok.toml")
    code, out = cli(["explain", str(path), "--set", item], capsys)
    assert code == 2 and "Traceback" not in out
    for fragment in fragments:
        assert fragment in out, out


def test_set_and_shortcuts_change_the_plan(tmp_path, capsys):
    path = write(tmp_path, "[training]\nmax_steps = 3\n", "ok.toml")
    code, out = cli(["explain", str(path), "--json", "--set", "training.batch_size=3",
                     "--max-steps", "7", "--seed", "5", "--log-dir", str(tmp_path / "L")],
                    capsys)
    assert code == 0, out
    import json

    report = json.loads(out)
    assert report["settings"]["training.batch_size"] == 3
    assert report["settings"]["training.max_steps"] == 7
    assert report["settings"]["training.seed"] == 5
    assert report["runs"][0]["folder"] == str(tmp_path / "L" / "ok")


def test_bad_shortcut_names_the_flag(tmp_path, capsys):
    path = write(tmp_path, "[training]\nmax_steps = 3\n", "ok.toml")
    code, out = cli(["explain", str(path), "--max-steps", "-1"], capsys)
    assert code == 2 and "--max-steps" in out and "must be >= 0" in out
    code, out = cli(["explain", str(path), "--max-steps", "0"], capsys)  # 0 needs an [sft] stage
    assert code == 2 and "training.max_steps: is 0 and there is no [sft] stage" in out
    code, out = cli(["explain", str(path), "--seed", "-3"], capsys)
    assert code == 2 and "--seed" in out


def test_override_cannot_hide_a_bad_section(tmp_path):
    path = write(tmp_path, "training = 5\n")
    with pytest.raises(ConfigError, match="must be a table"):
        config_file.load_config(path, {"training.lr": 1e-4})


def test_run_config_applies_dotted_changes():
    cfg = config.run_config(Config(), **{"training.lr": 2e-5, "backend.options.x": {"y": 1}})
    assert cfg.training.lr == 2e-5 and cfg.backend.options == {"x": {"y": 1}}
    with pytest.raises(ConfigError):
        config.run_config(Config(), **{"training.lr": -1.0})


def test_condition_tables_accept_dotted_and_nested_forms():
    cfg, plan = config_file.loads("""
[campaign]
seeds = [1]
[[campaign.conditions]]
name = "a"
training.lr = 2e-5
"backend.options" = { region = "eu" }
[[campaign.conditions]]
name = "b"
"training.lr" = 3e-5
backend.options.x = 1
""")
    a, b = plan.conditions
    assert a.overrides == {"training.lr": 2e-5, "backend.options": {"region": "eu"}}
    assert b.overrides["training.lr"] == 3e-5
    run_b = config.run_config(cfg, **b.overrides)
    assert run_b.backend.options == {"x": 1} and run_b.training.lr == 3e-5


def test_table_overrides_merge_instead_of_dropping_keys():
    cfg = config_file.loads_config('[backend]\noptions = { keep = 1, deep = { a = 1 } }\n')
    for change in ({"backend.options": {"deep": {"b": 2}}}, {"backend.options.deep.b": 2}):
        run = config.run_config(cfg, **change)
        assert run.backend.options == {"keep": 1, "deep": {"a": 1, "b": 2}}
    run = config.run_config(cfg, **{"backend.options.keep": [1, 2]})
    assert run.backend.options["keep"] == [1, 2]


# ---------------------------------------------------------------------------- round trip

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_key = st.one_of(st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True), _text)
_scalar = st.one_of(st.booleans(), st.integers(-2**63, 2**63 - 1),
                    st.floats(allow_nan=False, allow_infinity=False), _text)
_free = st.recursive(
    _scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(_key, inner, max_size=4)),
    max_leaves=12)
_free_table = st.dictionaries(_key, _free, max_size=4)


def _field_strategy(section: str, f: dataclasses.Field):
    tp = hints_of(FILE_SECTIONS[section])[f.name]
    meta = f.metadata
    if meta.get("choices"):
        return st.sampled_from(meta["choices"])
    if tp is bool:
        return st.booleans()
    lo, hi = meta.get("lo"), meta.get("hi")
    if tp is int:
        return st.integers(int(lo) if lo is not None else -2**40, int(hi) if hi else 2**40)
    if tp == int | str:   # a number or one of its words ("auto")
        return st.one_of(st.integers(int(lo), int(hi)), st.sampled_from(meta["words"]))
    if tp == bool | str:
        return st.one_of(st.booleans(), st.sampled_from(meta["words"]))
    if tp == float | str:
        return st.one_of(st.floats(lo, hi, allow_nan=False, allow_infinity=False),
                         st.sampled_from(meta["words"]))
    if tp is float:
        lo_v = lo if lo is not None else -1e9
        return st.floats(lo_v, hi if hi is not None else 1e9, exclude_min=bool(meta["lo_open"]),
                         allow_nan=False, allow_infinity=False)
    if tp is str:
        return _text
    if tp is dict:
        return _free_table
    if tp == list[str]:
        return st.lists(_text, max_size=3)
    raise AssertionError(f"no strategy for {section}.{f.name}")


_OVERRIDES = {
    "training.lr": st.floats(1e-7, 1e-2),
    "training.max_steps": st.integers(1, 10**6),
    "algorithm.advantage": st.sampled_from(["grpo", "dr_grpo", "rloo", "maxrl"]),
    "data.operations": st.sampled_from([["+"], ["+", "-"], ["*"]]),
    "model.lora_target_modules": st.lists(_text, max_size=3),
    "reward.params": _free_table,
    "backend.options": _free_table,
    "backend.options.region": _free,
    "reward.params.scale": _free,
}


@st.composite
def configs(draw) -> tuple[Config, CampaignPlan]:
    cfg = Config()
    for section in config.SECTIONS:
        for name, f in config.section_fields(section).items():
            if draw(st.booleans()):
                setattr(getattr(cfg, section), name, draw(_field_strategy(section, f)))
    _satisfy_cross_checks(cfg)
    camp = CampaignPlan()
    camp.seeds = draw(st.lists(st.integers(0, 2**31), unique=True, max_size=4))
    camp.parallel = draw(st.booleans())
    camp.max_workers = draw(st.integers(0, 64))
    camp.stagger_seconds = draw(st.floats(0, 1e4))
    names = draw(st.lists(st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True),
                          unique=True, max_size=4))
    camp.conditions = [
        Condition(name=n, overrides=draw(st.fixed_dictionaries(
            {}, optional={k: v for k, v in _OVERRIDES.items()}))) for n in names]
    if draw(st.booleans()):
        camp.grid = {"training.lr": draw(st.lists(st.floats(1e-6, 1e-3), min_size=1,
                                                  max_size=3))}
    return cfg, camp


def _satisfy_cross_checks(cfg: Config) -> None:
    if cfg.data.source in ("jsonl", "hf") and not cfg.data.path:
        cfg.data.path = "data.jsonl"
    ops = [o for o in cfg.data.operations if o in ("+", "-", "*")]
    cfg.data.operations = ops or ["+"]
    if cfg.reward.type == "custom" and not cfg.reward.function:
        cfg.reward.function = "rewards:score"
    if cfg.reward.type == "format":
        cfg.reward.pattern = "\\\\boxed"
    # [reward.judge] is a checked table, not free-form: a valid one for the judge, else none
    cfg.reward.judge = {"base_url": "http://127.0.0.1:1/v1", "model": "m"} \
        if cfg.reward.type == "judge" else {}
    t = cfg.training
    # [sft] and its [sft.data] table: a stage with its data and steps or epochs, or none
    s = cfg.sft
    if s != type(s)() or t.max_steps == 0:
        s.data = {"path": "chat.jsonl"}
        if bool(s.steps) == bool(s.epochs):
            s.steps, s.epochs = max(s.steps, 1), 0
    t.group_size = min(t.group_size, max(1, config.MAX_COMPLETIONS // t.batch_size))
    if t.max_steps_off_policy and cfg.backend.backend != "tinker":
        t.max_steps_off_policy = 0
    if t.mini_batches > t.batch_size and not cfg.backpressure.enabled:
        t.mini_batches = t.batch_size
    if t.lr_schedule == "constant":
        t.min_lr_ratio = 0.0
    if not t.refill:
        t.max_refill_rounds = 4
    a = cfg.algorithm
    if not a.kl_coef:
        a.kl_in, a.kl_estimator = "reward", "k1"
    elif cfg.backend.backend == "tinker":
        a.kl_in = "reward"
    r = cfg.reward
    r.overlong_buffer = min(r.overlong_buffer, t.max_tokens)
    if not r.overlong_buffer:
        r.overlong_penalty = 1.0
    if cfg.environment.tools:
        r.overlong_buffer, r.overlong_penalty = 0, 1.0
    be = cfg.backend
    be.max_concurrent_max = max(be.max_concurrent_max, be.max_concurrent_min)
    if t.budget_usd and all(v == "none" for v in vars(cfg.cost).values()):
        cfg.cost.device_hour = 1.0  # a money budget needs a price
    if 0 < be.fast_ratio_cap < 1:
        be.fast_ratio_cap = 1.0 + be.fast_ratio_cap
    if t.lr * t.weight_decay >= 1:
        t.weight_decay = 0.5 / t.lr
    env = cfg.environment
    if env.kind != "task":  # [data]'s task keys and [reward] belong to the task kind
        eval_size = cfg.data.eval_size
        cfg.data, cfg.reward = config.DataConfig(eval_size=eval_size), config.RewardConfig()
        env.factory = env.factory or "my_env.py:MyEnv"
    if not cfg.model.name.strip():
        cfg.model.name = "tiny-random"
    if cfg.logging.run_name and run_name_problem(cfg.logging.run_name):
        cfg.logging.run_name = "run"
    a = cfg.algorithm
    if a.loss in ("stable_reinforce", "custom"):
        a.loss = "ppo"
    if a.loss != "ppo" or cfg.backend.backend == "tinker" or a.clip_ratio_c <= 1:
        a.clip_ratio_c = 0.0
    if cfg.backend.backend == "tinker" and a.loss == "dro":
        a.loss = "importance_sampling"
    if be.backend == "tinker" or be.sampler == "fast":  # full fine-tuning: local, no merge
        cfg.model.finetune = "lora"
    bp = cfg.backpressure
    bp.max_batch_size = max(bp.max_batch_size, bp.min_batch_size)
    if bp.enabled and bp.increase_margin == 0:
        bp.increase_margin = 0.5
    d = cfg.distributed  # several ranks: local, on-policy, a rank's groups, no GPU asked here
    if be.backend == "tinker" or t.max_steps_off_policy or (
            d.nproc_per_node != "auto" and cfg.model.device in ("cuda", "auto")):
        d.nproc_per_node = 1
    elif d.nproc_per_node != "auto":
        d.nproc_per_node = min(d.nproc_per_node, t.batch_size,
                               bp.min_batch_size if bp.enabled else t.batch_size)
    if cfg.model.finetune != "full" and cfg.distributed.shard == "fsdp":  # LoRA: replicated
        cfg.distributed.shard = "none"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_dump_load_round_trip(pair):
    cfg, plan = pair
    assert cross_checks(cfg) == []
    text = config_file.dumps_config(cfg, plan)
    back = config_file.parse(toml_io.loads(text))
    assert back == pair
    assert config_file.dumps_config(*back) == text


@settings(max_examples=50, deadline=None)
@given(configs())
def test_round_trip_through_a_file(tmp_path_factory, pair):
    path = tmp_path_factory.mktemp("rt") / "resolved.toml"
    path.write_text(config_file.dumps_config(*pair), encoding="utf-8")
    assert config_file.read_file(path) == pair


def test_round_trip_keeps_free_form_tables_in_conditions():
    pair = config_file.loads("""
[backend]
options = { nested = { deep = [1, 2.5, "x", { t = true }] } }
[reward]
params = { "dotted.key" = "v", "" = 0 }
[campaign]
seeds = [3, 1]
[[campaign.conditions]]
name = "a"
"backend.options" = { region = "eu", list = [{ a = 1 }, { b = 2 }] }
"reward.params.scale" = 0.5
[campaign.grid]
"training.lr" = [1e-5, 2e-5]
""")
    assert config_file.loads(config_file.dumps_config(*pair)) == pair


@pytest.mark.parametrize("key, value", [
    ("training.batch_size", 10**12), ("training.group_size", config.MAX_GROUP + 1),
    ("training.max_tokens", config.MAX_TOKENS + 1), ("training.max_steps", 10**12),
    ("data.size", 10**10), ("model.lora_rank", 10**9), ("campaign.max_workers", 10**6),
])
def test_absurd_sizes_are_config_errors(key, value):
    section, name = key.split(".")
    with pytest.raises(ConfigError, match=f"{name}: must be <= "):
        config_file.parse({section: {name: value}})


def test_completions_per_step_are_bounded_across_keys():
    with pytest.raises(ConfigError, match="completions per step"):
        config.from_dict({"training": {"batch_size": 65536, "group_size": 64}})
    config.from_dict({"training": {"batch_size": 256, "group_size": 4096}})  # 1048576: fine


def test_diff_names_each_changed_key_with_both_values():
    before = {"training": {"lr": 1e-5, "seed": 1}, "backend": {"options": {"a": 1}}}
    after = {"training": {"lr": 2e-5, "seed": 1}, "backend": {"options": {"a": 2}},
             "model": {"name": "x"}}
    assert config_file.diff(before, after) == {
        "backend.options": ({"a": 1}, {"a": 2}),
        "model.name": (None, "x"),
        "training.lr": (1e-5, 2e-5),
    }
    assert config_file.diff(after, after) == {}


def test_a_file_checks_the_tables_inside_its_sections(tmp_path):
    """[reward.judge] and [sft.data] are checked when a file is read, not only from a dict:
    a bad key is a ConfigError naming it, never a TypeError when the table is used."""
    path = write(tmp_path, '[reward]\ntype = "judge"\n[reward.judge]\nbase_url = "http://x/v1"'
                 '\nmodel = "m"\nbogus = 1\n[sft]\nsteps = 2\n[sft.data]\npth = "c.jsonl"\n')
    with pytest.raises(ConfigError) as err:
        config_file.load_config(path)
    assert "reward.judge.bogus: unknown key" in str(err.value)
    assert "sft.data.pth: unknown key (did you mean 'path'?)" in str(err.value)
