"""What `retrain explain` says a run or a campaign will cost, as two figures: the upper bound
from the config and the data's prompt lengths (counted with the model's tokenizer where the
model is on this machine, else left out and said so), and the expected figure from the rows
of the pilot the wall-time estimate found, scaled to the planned steps and evaluations.
Dollars only where [cost] prices a part, and the prices are named with their file."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from retrain.bill import estimate
from retrain.bill.estimate import Bound, RunShape
from retrain.bill.prices import Prices, price, usd_text
from retrain.bill.tally import Tally
from retrain.campaign.plan import CampaignPlan
from retrain.config.cost_section import prices as cost_prices
from retrain.config.sections import Config
from retrain.runfiles import runlog

LIMIT = 4000  # prompts counted with the tokenizer; of a larger split, the longest by characters


@dataclass
class CostEstimate:
    prices_from: str                      # "[cost] in FILE", or "" with no price
    prices: dict[str, float]
    bound: Tally
    left_out: list[str]                   # parts the bound could not count
    bound_usd: float | None               # None: nothing priced
    expected: Tally | None = None         # None: no pilot
    expected_usd: float | None = None
    race: str = ""                        # a race's fewest and most runs, in money or tokens
    lines: list[tuple[str, str]] = field(default_factory=list)


class PromptTokens:
    """Prompt lengths of each run's data, counted once per model, data and seed."""

    def __init__(self, config_dir: Path):
        self.config_dir = config_dir
        self._tokenizers: dict[str, Any] = {}
        self._counted: dict[str, tuple[int | None, int | None, int]] = {}

    def tokenizer(self, name: str) -> Any:
        if name not in self._tokenizers:
            from retrain.cli.explain.sft import local_tokenizer

            self._tokenizers[name] = local_tokenizer(name, self.config_dir)
        return self._tokenizers[name]

    def count(self, cfg: Config) -> tuple[int | None, int | None, int]:
        """(the longest training prompt, one evaluation's prompts summed, its problems);
        None where the tokenizer is not on this machine."""
        from retrain.config import toml_io
        from retrain.config.sections import to_dict

        key = toml_io.dumps({"data": to_dict(cfg)["data"], "model": cfg.model.name,
                             "seed": cfg.training.seed})
        if key not in self._counted:
            self._counted[key] = self._count(cfg)
        return self._counted[key]

    def _count(self, cfg: Config) -> tuple[int | None, int | None, int]:
        from retrain.environments.tasks import load_task, render_prompt

        splits = load_task(cfg.data, cfg.training.seed, self.config_dir)
        tok = self.tokenizer(cfg.model.name)
        if tok is None:
            return None, None, len(splits.eval)
        train = list(splits.train)
        if len(train) > LIMIT:
            train = sorted(train, key=lambda p: len(p.prompt), reverse=True)[:LIMIT]
        longest = max((len(render_prompt(tok, p, cfg.data)) for p in train), default=0)
        evals = sum(len(render_prompt(tok, p, cfg.data)) for p in splits.eval)
        return longest, evals, len(splits.eval)


def evals_of(max_steps: int, every: int) -> int:
    """Held-out evaluations of a fresh run: before step 1, every `every`-th step and the last."""
    if max_steps <= 0:
        return 0
    due = sum(1 for s in range(1, max_steps + 1) if s == max_steps or (every and s % every == 0))
    return 1 + due


def shape_of(cfg: Config, counter: PromptTokens, sft_steps: int) -> RunShape:
    """What bounds the run of `cfg`'s tokens (`sft_steps`: its [sft] stage's steps)."""
    from retrain.environments.kinds import episode_token_bound

    t, bp, env = cfg.training, cfg.backpressure, cfg.environment
    sft = sft_steps * cfg.sft.batch_size * cfg.sft.max_tokens if cfg.sft.enabled else 0
    task = env.kind == "task"
    longest, eval_tokens, eval_n = counter.count(cfg) if task and t.max_steps else (
        None, None, cfg.data.eval_size)
    return RunShape(
        steps=t.max_steps, batch=bp.max_batch_size if bp.enabled else t.batch_size,
        rounds=1 + (t.max_refill_rounds if t.refill else 0), group=t.group_size,
        max_tokens=t.max_tokens if task else episode_token_bound(env, t.max_tokens),
        epochs=t.epochs, reference=cfg.algorithm.kl_coef > 0, prompt_tokens=longest,
        evals=evals_of(t.max_steps, t.eval_every) if eval_n else 0, eval_prompts=eval_n,
        eval_prompt_tokens=eval_tokens, sft_tokens=sft,
        judge=cfg.reward.type == "judge" and task)


def run_bound(cfg: Config, counter: PromptTokens) -> Bound:
    """One run's upper bound (the campaign runner's check before it starts a run)."""
    from retrain.cli.explain.data import DataReader

    sft_steps = DataReader(counter.config_dir).read(cfg).sft_steps if cfg.sft.enabled else 0
    return estimate.bound(shape_of(cfg, counter, sft_steps))


def pilot_expected(pilot_run: str, cfgs: list[Config], sft_tokens: int) -> Tally:
    """The pilot's measured spend per step and per evaluation, scaled to the runs of `cfgs`
    (their SFT stages at their bound, `sft_tokens`)."""
    rows = runlog.read_metrics(Path(pilot_run) / runlog.METRICS_FILE).rows
    per_step, per_eval = estimate.pilot_rates(
        [(Tally.of_row(r), _evals_on(r)) for r in rows if isinstance(r.get("step"), int)])
    total = Tally(trained=sft_tokens)
    for c in cfgs:
        t = c.training
        evals = evals_of(t.max_steps, t.eval_every) if c.data.eval_size else 0
        total = total + estimate.expected(per_step, per_eval, t.max_steps, evals)
    return total


def _evals_on(row: dict) -> int:
    return sum(row.get(k) is not None for k in ("eval_accuracy", "initial_eval_accuracy"))


def cost_estimate(path: Path, cfg: Config, camp: CampaignPlan, plans: list[Any],
                  run_cfgs: list[Config], pilot_run: str | None) -> CostEstimate:
    """The run's (or campaign's) bound and expected figure; `plans`: explain's run plans
    (their sft_steps), `run_cfgs` their configs, in the same order."""
    counter = PromptTokens(path.parent)
    shapes = [shape_of(c, counter, p.sft_steps) for p, c in zip(plans, run_cfgs, strict=True)]
    bounds = [estimate.bound(s) for s in shapes]
    bound = sum(bounds, Bound())
    prices = cost_prices(cfg.cost)
    usd = _usd(bound.tally, prices)
    out = CostEstimate(prices_from=f"[cost] in {path}" if prices.any else "",
                       prices=prices.given(), bound=bound.tally, left_out=bound.left_out,
                       bound_usd=usd)
    if pilot_run is not None:
        out.expected = pilot_expected(pilot_run, run_cfgs, sum(s.sft_tokens for s in shapes))
        out.expected_usd = _usd(out.expected, prices)
    if camp.is_campaign and camp.race:
        out.race = race_cost(camp, plans, bounds, prices)
    out.lines = _lines(out, prices, pilot_run, len(plans), cfg)
    return out


def _usd(t: Tally, prices: Prices) -> float | None:
    return price(t, prices).usd


def race_cost(camp: CampaignPlan, plans: list[Any], bounds: list[Bound], prices: Prices) -> str:
    """The race's fewest and most runs at the dearest run's bound: dollars, or tokens."""
    from retrain.campaign.race import bounds as race_bounds
    from retrain.campaign.race_plan import race_of

    race = race_of(camp.race)
    conditions = len(dict.fromkeys(p.condition for p in plans))
    fewest, most = race_bounds(race, len(dict.fromkeys(p.seed for p in plans)), conditions)
    dearest = max((b.tally for b in bounds), key=lambda t: (_usd(t, prices) or 0, t.tokens))

    def figure(n: int) -> str:
        t = estimate.times(dearest, n)
        return estimate.money_text(t, prices, False) if prices.any else f"{t.tokens:,} tokens"

    return (f"fewest runs ({fewest}) at most {figure(fewest)}, most runs ({most}) at most "
            f"{figure(most)} (each run at the dearest run's bound)")


def _lines(e: CostEstimate, prices: Prices, pilot_run: str | None, runs: int,
           cfg: Config) -> list[tuple[str, str]]:
    whose = f"{runs} runs" if runs > 1 else "the run"
    money = estimate.money_text(e.bound, prices, False)
    out = [("prices", "; ".join(f"{k} {usd_text(v)}" for k, v in e.prices.items())
            + f" ({e.prices_from})" if prices.any
            else "no prices: tokens and device-hours only"),
           ("cost bound", f"{whose}: at most {estimate.tokens_text(e.bound)}"
            + (f", {money}" if money else "") + "".join(
                f"; leaves out {w}: {_why(w, cfg)}" for w in e.left_out))]
    if e.expected is None:
        out.append(("cost expected", "unknown: run a pilot (as for the wall time)"))
    else:
        money = estimate.money_text(e.expected, prices, True)
        out.append(("cost expected", f"~{estimate.tokens_text(e.expected)}, "
                    f"{e.expected.device_hours:.3g} device-h" + (f", {money}" if money else "")
                    + f"; from {pilot_run}'s rows, per step and per evaluation"))
    if e.race:
        out.append(("race cost", e.race))
    return out


def _why(left_out: str, cfg: Config) -> str:
    if left_out == "judge tokens":
        return "a judge's tokens have no bound before the run (its prompts and replies)"
    if cfg.environment.kind != "task":
        return "an environment's messages are known only as its episodes run"
    return (f"the tokenizer of model.name = {cfg.model.name!r} is not on this machine yet "
            "(the run loads it)")
