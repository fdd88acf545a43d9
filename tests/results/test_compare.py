"""`retrain compare`: means, Student t intervals, paired and Welch differences checked against
scipy computed here, independently (the textbook formulas), and the edge cases."""

from __future__ import annotations

import json
import math

import pytest

stats = pytest.importorskip("scipy.stats")

from retrain.cli.app import run_app  # noqa: E402
from retrain.results.compare import build  # noqa: E402
from retrain.results.compare_view import plain_lines  # noqa: E402
from tests.results_helpers import snapshot, write_campaign, write_run  # noqa: E402

# Final rewards with --last 2 are the mean of each run's last two rewards.
A = {1: [0.0, 0.2, 0.4, 0.6], 2: [0.1, 0.1, 0.4, 0.5], 3: [0.0, 0.3, 0.5, 0.8]}
B = {1: [0.0, 0.0, 0.1, 0.1], 2: [0.1, 0.0, 0.0, 0.2], 3: [0.0, 0.1, 0.3, 0.1]}
EVALS_A = {1: 0.5, 2: 0.625, 3: 0.375}
EVALS_B = {1: 0.25, 2: 0.125, 3: 0.25}


def _t_interval(xs):
    n, mean = len(xs), sum(xs) / len(xs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def _welch(xs, ys):
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    vx = sum((x - mx) ** 2 for x in xs) / (len(xs) - 1) / len(xs)
    vy = sum((y - my) ** 2 for y in ys) / (len(ys) - 1) / len(ys)
    df = (vx + vy) ** 2 / (vx ** 2 / (len(xs) - 1) + vy ** 2 / (len(ys) - 1))
    half = stats.t.ppf(0.975, df) * math.sqrt(vx + vy)
    return mx - my, mx - my - half, mx - my + half, df


def _paired(xs, ys):
    ds = [x - y for x, y in zip(xs, ys, strict=True)]
    n, mean = len(ds), sum(ds) / len(ds)
    sd = math.sqrt(sum((d - mean) ** 2 for d in ds) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half, n - 1


def _campaign(tmp_path, extra=None):
    runs = {("good", s): {"rewards": r, "evals": {2: 0.0, 4: EVALS_A[s]}} for s, r in A.items()}
    runs |= {("slow", s): {"rewards": r, "evals": {2: 0.0, 4: EVALS_B[s]}}
             for s, r in B.items()}
    runs |= extra or {}
    return write_campaign(tmp_path / "camp", runs)


def test_means_intervals_and_paired_differences_match_the_textbook(tmp_path):
    """Both conditions ran seeds 1, 2, 3: the difference is the paired t interval of the
    per-seed differences, and the verdict names the test and the seeds."""
    report = build(_campaign(tmp_path), baseline="slow", last=2)
    good, slow = report.conditions
    finals_a = [sum(r[-2:]) / 2 for r in A.values()]
    finals_b = [sum(r[-2:]) / 2 for r in B.values()]
    for got, xs in ((good.final_reward, finals_a), (slow.final_reward, finals_b),
                    (good.eval_accuracy, list(EVALS_A.values()))):
        assert got.n == 3
        assert (got.mean, got.lo, got.hi) == pytest.approx(_t_interval(xs), abs=1e-12)
    diff, lo, hi, df = _paired(finals_a, finals_b)
    d = good.vs_baseline[0]
    assert (d.diff, d.lo, d.hi, d.df) == pytest.approx((diff, lo, hi, df), abs=1e-12)
    assert (d.test, d.seeds, d.unpaired) == ("paired t", (1, 2, 3), ())
    assert lo > 0 and d.verdict.endswith("(paired t, seeds 1, 2, 3): good is higher than slow")
    e = good.vs_baseline[1]
    assert (e.diff, e.lo, e.hi) == pytest.approx(
        _paired(list(EVALS_A.values()), list(EVALS_B.values()))[:3], abs=1e-12)
    # Welch on the same values is wider: the seeds' shared luck is not taken out.
    assert _welch(finals_a, finals_b)[2] - _welch(finals_a, finals_b)[1] > hi - lo
    assert (good.rank, slow.rank) == (1, 2) and slow.vs_baseline == []
    assert good.tokens_per_second.mean == 100.0 and good.best_eval_step.mean == 4.0


def test_default_window_threshold_and_time_to_threshold(tmp_path):
    report = build(_campaign(tmp_path))
    assert report.baseline == "good"  # the first condition
    # 4 steps: 10% rounds down to 0, so at least 1 step: the final reward is the last reward
    finals = sorted([r[-1] for r in A.values()] + [r[-1] for r in B.values()])
    assert report.threshold == pytest.approx((finals[2] + finals[3]) / 2)
    assert report.threshold_source.startswith("median")
    first = {s: next(i for i, x in enumerate(r, 1) if x >= report.threshold)
             for s, r in A.items()}
    good = report.conditions[0]
    assert good.reached == 3
    assert good.steps_to_threshold.mean == pytest.approx(sum(first.values()) / 3)
    assert good.seconds_to_threshold.mean == pytest.approx(2.0 * sum(first.values()) / 3)
    slow = report.conditions[1]
    assert slow.reached == 0 and slow.steps_to_threshold.n == 0


def test_conditions_without_shared_seeds_fall_back_to_welch(tmp_path):
    """Seeds 1, 2 against seeds 3, 4: nothing to pair, Welch over every value (one side
    without spread still has an interval)."""
    camp = write_campaign(tmp_path / "c", {
        ("x", 1): {"rewards": [0.5]}, ("x", 2): {"rewards": [0.5]},
        ("y", 3): {"rewards": [0.1]}, ("y", 4): {"rewards": [0.3]}})
    d = build(camp).conditions[1].vs_baseline[0]
    assert (d.diff, d.lo, d.hi, d.df) == pytest.approx(_welch([0.1, 0.3], [0.5, 0.5]))
    assert d.test == "Welch" and "(Welch, 2 and 2 seeds): not distinguishable" in d.verdict


def test_seeds_only_one_side_has_are_left_out_of_the_pairs_and_named(tmp_path):
    camp = write_campaign(tmp_path / "c", {
        ("x", 1): {"rewards": [0.5]}, ("x", 2): {"rewards": [0.4]}, ("x", 3): {"rewards": [0.9]},
        ("y", 1): {"rewards": [0.1]}, ("y", 2): {"rewards": [0.3]}, ("y", 4): {"rewards": [0.0]}})
    d = build(camp).conditions[1].vs_baseline[0]
    assert (d.diff, d.lo, d.hi) == pytest.approx(_paired([0.1, 0.3], [0.5, 0.4])[:3])
    assert (d.seeds, d.unpaired) == ((1, 2), (3, 4))
    assert "(paired t, seeds 1, 2; seeds 3, 4 unpaired, left out)" in d.verdict


def test_indistinguishable_conditions_say_so(tmp_path):
    camp = write_campaign(tmp_path / "c", {
        ("x", 1): {"rewards": [0.2]}, ("x", 2): {"rewards": [0.6]},
        ("y", 1): {"rewards": [0.3]}, ("y", 2): {"rewards": [0.5]}})
    d = build(camp).conditions[1].vs_baseline[0]
    assert d.lo < 0 < d.hi and d.verdict.endswith("not distinguishable with these seeds")


def test_one_seed_has_no_interval(tmp_path, capsys):
    camp = write_campaign(tmp_path / "c", {("a", 1): {"rewards": [0.5, 0.7]},
                                           ("b", 1): {"rewards": [0.1, 0.2]},
                                           ("b", 2): {"rewards": [0.2, 0.2]}})
    report = build(camp, last=1)
    a, b = report.conditions
    assert (a.final_reward.n, a.final_reward.mean, a.final_reward.lo) == (1, 0.7, None)
    d = b.vs_baseline[0]
    assert d.diff == pytest.approx(0.2 - 0.7) and d.lo is None and "no interval" in d.verdict
    assert run_app(["compare", str(camp), "--last", "1"]) == 0
    assert "0.7 (n = 1, no interval)" in capsys.readouterr().out


def test_failed_and_running_runs_are_listed_and_excluded(tmp_path, capsys):
    camp = _campaign(tmp_path, {
        ("good", 4): {"rewards": [9.0, 9.0], "state": "failed", "error": "CUDA on fire\nmore"},
        ("slow", 4): {"rewards": [9.0], "state": "running"},
        **{("slow", s): {"rewards": [], "state": "pending"} for s in (5, 6, 7, 8)}})
    report = build(camp, last=2)
    good, slow = report.conditions
    assert (good.runs, good.completed, slow.runs, slow.completed) == (4, 3, 8, 3)
    assert good.final_reward.mean == pytest.approx(sum(sum(r[-2:]) / 2 for r in A.values()) / 3)
    assert sorted((r.name, r.state) for r in report.excluded) == [
        ("good_s4", "failed"), ("slow_s4", "running"), ("slow_s5", "pending"),
        ("slow_s6", "pending"), ("slow_s7", "pending"), ("slow_s8", "pending")]
    assert run_app(["compare", str(camp)]) == 0
    out = capsys.readouterr().out
    assert "excluded from the means: good_s4 (failed: CUDA on fire)" in out
    assert "excluded from the means: slow_s4 (running)" in out
    # runs a race has not released yet: one line, not one each
    assert ("not started yet, so not in the means: 4 runs (slow_s5, slow_s6, slow_s7, ...; "
            "retrain status lists them)") in out
    assert "slow_s8" not in out


def test_missing_eval(tmp_path, capsys):
    camp = write_campaign(tmp_path / "c", {
        ("a", 1): {"rewards": [0.1]}, ("a", 2): {"rewards": [0.2]},
        ("b", 1): {"rewards": [0.3], "evals": {1: 0.5}}, ("b", 2): {"rewards": [0.4]}})
    a, b = build(camp).conditions
    assert a.eval_accuracy.n == 0 and a.eval_accuracy.mean is None
    assert (b.eval_accuracy.n, b.eval_accuracy.mean) == (1, 0.5)
    assert b.vs_baseline[1].verdict == "no eval accuracy for a"
    assert run_app(["compare", str(camp)]) == 0
    assert "b vs a: no eval accuracy for a" in capsys.readouterr().out


def test_the_sampled_evals_mean_and_pass_at_k_are_compared_by_their_row_names(tmp_path, capsys):
    """Runs with training.eval_samples > 1: eval_mean_at_k and eval_pass_at_k at the last eval,
    across seeds and against the baseline (paired); as the race reads them too."""
    from retrain.results.run_figures import race_value

    mean_k = {("a", 1): 0.30, ("a", 2): 0.35, ("a", 3): 0.40,
              ("b", 1): 0.50, ("b", 2): 0.60, ("b", 3): 0.62}
    runs = {key: {"rewards": [0.1, 0.2], "evals": {1: 0.0, 2: 0.5},
                  "extra": {1: {"eval_mean_at_k": 0.0, "eval_pass_at_k": 0.0},
                            2: {"eval_mean_at_k": m, "eval_pass_at_k": 0.75}}}
            for key, m in mean_k.items()}
    camp = write_campaign(tmp_path / "c", runs)
    a, b = build(camp).conditions
    assert (a.eval_mean_at_k.mean, b.eval_pass_at_k.mean) == pytest.approx((0.35, 0.75))
    d = next(d for d in b.vs_baseline if d.metric == "eval mean@k")
    xs, ys = [mean_k["b", s] for s in (1, 2, 3)], [mean_k["a", s] for s in (1, 2, 3)]
    assert (d.diff, d.lo, d.hi) == pytest.approx(_paired(xs, ys)[:3], abs=1e-12)
    assert race_value(camp / "b_s2", "eval_mean_at_k") == 0.60
    assert race_value(camp / "b_s2", "eval_pass_at_k") == 0.75
    assert run_app(["compare", str(camp)]) == 0
    out = capsys.readouterr().out
    assert "eval mean@k" in out and "eval pass@k" in out and "b vs a: " in out
    greedy = build(_campaign(tmp_path))  # rows without them: the report as before
    assert [d.metric for d in greedy.conditions[1].vs_baseline] == ["final reward",
                                                                    "eval accuracy"]
    assert not any("mean@k" in line for line in plain_lines(greedy))


def test_grid_cells_are_conditions_with_their_values(tmp_path):
    cells = {"grpo_lr-0.01": {"training.lr": 0.01}, "grpo_lr-0.0001": {"training.lr": 1e-4}}
    runs = {(c, s): {"rewards": [0.1 * s + (0.5 if "0.01" in c else 0)]}
            for c in cells for s in (1, 2)}
    report = build(write_campaign(tmp_path / "g", runs, overrides=cells))
    assert [c.name for c in report.conditions] == list(cells)
    assert [c.overrides for c in report.conditions] == list(cells.values())
    assert [c.rank for c in report.conditions] == [1, 2]


def test_torn_and_garbage_metrics_lines_are_skipped_and_counted(tmp_path):
    camp = _campaign(tmp_path)
    clean = build(camp, last=2)
    with open(camp / "good_s1" / "metrics.jsonl", "ab") as fh:
        fh.write(b"not json\n[1, 2]\n{\"step\": 5, \"mean_rew")
    torn = build(camp, last=2)
    assert torn.bad_lines == 3 and clean.bad_lines == 0
    assert torn.conditions[0].final_reward == clean.conditions[0].final_reward


def test_torn_lines_are_named_with_their_run_and_file(tmp_path, capsys):
    camp = _campaign(tmp_path)
    with open(camp / "good_s1" / "metrics.jsonl", "ab") as fh:
        fh.write(b"not json\n{\"step\": 5, \"mean_rew")
    assert run_app(["compare", str(camp)]) == 0
    out = capsys.readouterr().out
    assert (f"rows left out of good_s1: {camp / 'good_s1' / 'metrics.jsonl'}: 2 torn or garbage "
            "lines") in out


def test_duplicate_step_and_non_finite_rows_are_dropped_not_averaged(tmp_path, capsys):
    """A step logged twice (which row is the step?) loses both rows; a row whose figures are
    NaN, infinite or null (the trainer's non-finite) is dropped whole; both are named."""
    camp = _campaign(tmp_path)
    with open(camp / "good_s1" / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "mean_reward": 100.0, "step_time_s": 2.0}\n'
                 '{"step": 5, "mean_reward": NaN}\n{"step": 6, "mean_reward": 1e999}\n'
                 '{"step": 7, "mean_reward": 0.5, "tokens_per_second": null}\n')
    report = build(camp, last=2)
    (fig,) = [r for r in report.runs if r.name == "good_s1"]
    assert fig.final_reward == pytest.approx((0.2 + 0.4) / 2)  # steps 2 and 3: 4 is dropped
    assert (fig.duplicate_rows, fig.non_finite_rows, fig.bad_lines) == (2, 3, 0)
    assert fig.tokens_per_second == 100.0
    assert run_app(["compare", str(camp), "--last", "2"]) == 0
    out = capsys.readouterr().out
    assert (f"rows left out of good_s1: {camp / 'good_s1' / 'metrics.jsonl'}: 2 rows of step "
            "logged more than once (step 4), 3 rows with a non-finite figure (steps 5, 6, 7)"
            ) in out
    assert out.count("rows left out of") == 1  # the clean runs are not named


def test_json_output_is_the_report(tmp_path, capsys):
    camp = _campaign(tmp_path)
    assert run_app(["compare", str(camp), "--json", "--last", "2", "--baseline", "slow"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["baseline"] == "slow" and data["last"] == 2
    good = data["conditions"][0]
    assert good["name"] == "good" and good["final_reward"]["n"] == 3
    assert good["vs_baseline"][0]["metric"] == "final reward"
    assert len(data["runs"]) == 6 and data["excluded"] == []


@pytest.mark.parametrize("args, message", [
    (["--baseline", "nope"], "--baseline 'nope' is not a condition"),
    (["--last", "0"], "--last 0"),
    (["--threshold", "nan"], "--threshold nan"),
])
def test_bad_input_is_one_error_line_and_changes_nothing(tmp_path, capsys, args, message):
    camp = _campaign(tmp_path)
    before = snapshot(camp)
    assert run_app(["compare", str(camp), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert snapshot(camp) == before


def test_not_a_campaign_folder(tmp_path, capsys):
    run = write_run(tmp_path / "run", [0.1])
    assert run_app(["compare", str(run)]) == 2
    assert "not a campaign folder" in capsys.readouterr().err
    assert run_app(["compare", str(tmp_path / "missing")]) == 2
    assert "no such campaign folder" in capsys.readouterr().err
    _campaign(tmp_path)
    assert run_app(["compare", str(tmp_path)]) == 2
    assert f"campaigns under it: {tmp_path / 'camp'}" in capsys.readouterr().err


def test_status_shows_the_comparison_when_a_condition_has_two_seeds(tmp_path, capsys):
    _campaign(tmp_path)
    assert run_app(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "final reward" in out and f"retrain compare {tmp_path / 'camp'}" in out
    assert run_app(["status", str(tmp_path), "--json"]) == 0
    (camp,) = json.loads(capsys.readouterr().out)["campaigns"]
    assert [c["name"] for c in camp["comparison"]["conditions"]] == ["good", "slow"]
    single = write_campaign(tmp_path / "one" / "c", {("a", 1): {"rewards": [0.1]},
                                                      ("b", 1): {"rewards": [0.2]}})
    assert run_app(["status", str(single.parent), "--json"]) == 0
    (camp,) = json.loads(capsys.readouterr().out)["campaigns"]
    assert "comparison" not in camp


def test_hostile_or_empty_manifests_are_not_fatal(tmp_path, capsys):
    camp = tmp_path / "camp"
    camp.mkdir()
    (camp / "manifest.json").write_text("{}")
    assert run_app(["compare", str(camp)]) == 2
    assert "has no runs yet" in capsys.readouterr().err
    write_run(camp / "a_s1", [0.1, 0.2])
    write_run(camp / "b_s1", [0.3], state="failed")
    for text in ('{"campaign": "camp", "runs": [{"name": "a_', json.dumps({
            "campaign": ["x"], "conditions": [{"a": 1}, "a", 3], "seeds": [[1], 1],
            "runs": [{"name": ["a_s1"], "log_dir": "../../..", "condition": {"x": 1},
                      "overrides": [1], "seed": "x"}, 5, None]})):
        (camp / "manifest.json").write_text(text)
        assert run_app(["compare", str(camp), "--json"]) == 0, capsys.readouterr().err
        report = json.loads(capsys.readouterr().out)
        assert {r["name"] for r in report["runs"]} >= {"a_s1", "b_s1"}


def test_rich_output_on_a_terminal_says_the_same(tmp_path, capsys, monkeypatch):
    from retrain.cli import render

    camp = _campaign(tmp_path)
    monkeypatch.setattr(render, "stdout_is_terminal", lambda: True)
    monkeypatch.setenv("COLUMNS", "250")
    assert run_app(["compare", str(camp), "--baseline", "slow"]) == 0
    out = capsys.readouterr().out
    assert "good vs slow: final reward" in out and "good is higher than slow" in out


# ---------------------------------------------------------------------------- huge values

HUGE = {("big", 1): {"rewards": [1e308] * 4, "tokens_per_second": 1.7e308},
        ("big", 2): {"rewards": [1.7e308] * 4, "tokens_per_second": 1.7e308},
        ("small", 1): {"rewards": [0.5] * 4}, ("small", 2): {"rewards": [0.7] * 4}}


def test_rewards_near_the_float_limit_are_compared_and_plotted(tmp_path, capsys):
    """Finite rewards of 1e308 are legal; their sums overflow, their means do not."""
    camp = write_campaign(tmp_path / "c", HUGE)
    assert run_app(["compare", str(camp), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    by = {c["name"]: c for c in report["conditions"]}
    assert by["big"]["final_reward"]["mean"] == pytest.approx(1.35e308)
    assert by["big"]["tokens_per_second"]["mean"] == pytest.approx(1.7e308)
    assert by["small"]["final_reward"]["mean"] == pytest.approx(0.6)
    (diff,) = [d for d in by["small"]["vs_baseline"] if d["metric"] == "final reward"]
    assert diff["diff"] == pytest.approx(0.6 - 1.35e308)
    assert run_app(["plot", str(camp)]) == 0
    assert (camp / "curves.png").stat().st_size > 0


def test_the_statistics_of_huge_values_match_the_scaled_textbook_ones():
    from retrain.results.stats import estimate, paired, welch

    xs, ys = [1.0e308, 1.2e308, 0.9e308], [0.95e308, 1.1e308, 1.0e308]  # sums overflow
    scale = 1e300  # the textbook formulas on values that do not overflow, scaled back
    m, lo, hi = _t_interval([x / scale for x in xs])
    e = estimate(xs)
    assert (e.mean, e.lo, e.hi) == pytest.approx((m * scale, lo * scale, hi * scale))
    d, dlo, dhi, df = _welch([x / scale for x in xs], [y / scale for y in ys])
    w = welch("r", xs, ys, "x", "y")
    assert (w.diff, w.lo, w.hi, w.df) == pytest.approx((d * scale, dlo * scale, dhi * scale, df))
    d, dlo, dhi, df = _paired([x / scale for x in xs], [y / scale for y in ys])
    p = paired("r", xs, ys, "x", "y")
    assert (p.diff, p.lo, p.hi, p.df) == pytest.approx((d * scale, dlo * scale, dhi * scale, df))


def test_mean_and_median_of_huge_values():
    from retrain.results.stats import mean, median

    assert mean([1.7e308, 1.7e308]) == pytest.approx(1.7e308)
    assert median([1.7e308, 1.6e308, 0.0, 1.7e308]) == pytest.approx(1.65e308)
    assert median([3.0, 1.0, 2.0]) == 2.0 and mean([1.0, 2.0]) == 1.5


def test_cost_per_condition_and_to_the_threshold(tmp_path, capsys):
    """The bill beside steps and seconds: each run's rows summed (100 sampled tokens a step),
    in dollars where its config's [cost] prices them (good: $1000 per million sampled
    tokens), in tokens where nothing does (slow): never a made-up price."""
    camp = _campaign(tmp_path)
    for folder in camp.iterdir():
        if not (folder / "metrics.jsonl").is_file():
            continue
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().split("\n")
                if line]
        (folder / "metrics.jsonl").write_text("".join(
            json.dumps({**r, "prefill_tokens": 0, "sampled_tokens": 100, "trained_tokens": 0})
            + "\n" for r in rows))
        if folder.name.startswith("good"):
            (folder / "config.toml").write_text("[cost]\nsample_per_mtok = 1000.0\n")
    report = build(camp)
    good, slow = report.conditions
    first = {s: next(i for i, x in enumerate(r, 1) if x >= report.threshold)
             for s, r in A.items()}
    assert good.cost_usd.mean == pytest.approx(4 * 100 * 1e-3)
    assert good.tokens_to_threshold.mean == pytest.approx(100 * sum(first.values()) / 3)
    assert good.cost_to_threshold.mean == pytest.approx(0.1 * sum(first.values()) / 3)
    assert slow.cost_usd.n == 0 and slow.tokens.mean == 400.0
    assert slow.cost_to_threshold.n == 0  # slow never reaches it
    assert run_app(["compare", str(camp)]) == 0
    out = capsys.readouterr().out
    assert "cost to thr" in out and "$0.4 [0.4, 0.4]" in out and "400 [400, 400] tok" in out


def _lines_run(fn) -> int:
    """How many lines of Python `fn()` executes (its callees' included): work, counted."""
    import sys

    count = 0

    def trace(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return trace

    before = sys.gettrace()
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(before)
    return count


def test_steps_to_threshold_is_linear_in_the_rows():
    """A rising reward that reaches the threshold at its end (a learning curve against the
    median final reward): the trailing mean of each step used to sum its window again (10% of
    the steps each), so twice the rows took four times the work (107 MB metrics: over 300 s)."""
    from retrain.results.run_figures import RunFigures, reach
    from retrain.results.stats import mean

    def work(n: int) -> int:
        rows = [{"step": i, "mean_reward": i / n, "step_time_s": 0.5} for i in range(1, n + 1)]
        final = mean([r["mean_reward"] for r in rows[-n // 10:]])  # its final reward
        fig = RunFigures()
        lines = _lines_run(lambda: reach(fig, rows, final, None))
        assert fig.steps_to_threshold == n and fig.seconds_to_threshold == n * 0.5
        return lines

    small, large = work(1000), work(2000)
    assert large < 2.3 * small, (small, large)
