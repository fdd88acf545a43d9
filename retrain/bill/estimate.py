"""The bill before a run: an upper bound on a run's tokens from its config and its data's
prompt lengths, and the expected figure scaled from a pilot's measured rows. Pure: no I/O.

The bound follows what the backends count (backends/base.py TokenUsage): each sample call
prefills each prompt once and samples `group` completions of at most `max_tokens`; each datum
trained is at most its prompt plus its completion, once per epoch; the reference model
(kl_coef) prefills each datum once more. Wall time has no bound before a run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from retrain.bill.prices import Prices, price, usd_text
from retrain.bill.tally import Tally


@dataclass(frozen=True)
class RunShape:
    """What bounds one run's tokens; `None` prompt lengths: not counted (left out)."""

    steps: int = 0                   # RL steps
    batch: int = 0                   # groups trained per step, at most
    rounds: int = 1                  # sampling rounds per step (refill adds some)
    group: int = 1                   # completions per prompt
    max_tokens: int = 0              # sampled tokens per completion (episode), at most
    epochs: int = 1                  # passes over a step's datums
    reference: bool = False          # kl_coef > 0: the base model's forward over each datum
    prompt_tokens: int | None = 0    # the longest training prompt
    evals: int = 0                   # held-out evaluations over the run
    eval_prompts: int = 0            # problems (episodes) of one evaluation
    eval_prompt_tokens: int | None = 0  # one evaluation's prompts, summed
    sft_tokens: int = 0              # the SFT stage's trained tokens, at most
    judge: bool = False              # a judge reward: its tokens have no bound here


@dataclass
class Bound:
    """An upper bound of tokens, and the parts it had to leave out (words)."""

    tally: Tally = field(default_factory=Tally)
    left_out: list[str] = field(default_factory=list)

    def __add__(self, other: Bound) -> Bound:
        return Bound(self.tally + other.tally,
                     list(dict.fromkeys(self.left_out + other.left_out)))


def bound(s: RunShape) -> Bound:
    """The most tokens a run of shape `s` can spend (see the module's docstring)."""
    prompt = s.prompt_tokens or 0
    sampled_n = s.batch * s.rounds * s.group   # completions sampled per step, at most
    datum = prompt + s.max_tokens              # a datum's tokens, at most
    trained_n = s.batch * s.group              # datums trained per step, at most
    prefill = s.steps * (s.batch * s.rounds * prompt
                         + (trained_n * datum if s.reference else 0))
    prefill += s.evals * (s.eval_prompt_tokens or 0)
    sampled = s.steps * sampled_n * s.max_tokens + s.evals * s.eval_prompts * s.max_tokens
    trained = s.steps * trained_n * datum * s.epochs + s.sft_tokens
    left = [what for what, unknown in (
        ("prompt tokens", (s.steps and s.prompt_tokens is None)
         or (s.evals and s.eval_prompt_tokens is None)),
        ("judge tokens", s.judge)) if unknown]
    return Bound(Tally(prefill=prefill, sampled=sampled, trained=trained), left)


def pilot_rates(rows: list[tuple[Tally, int]]) -> tuple[Tally, Tally]:
    """(per plain step, per evaluation) from a pilot's rows, each with the evaluations it
    holds: a row's evaluations cost what it spent beyond a plain step's mean. Evaluations
    train nothing, so trained tokens are every row's mean. Without a plain row, every row
    counts as a step and evaluations cost nothing extra."""
    if not rows:
        return Tally(), Tally()
    plain = [t for t, n in rows if n == 0] or [t for t, _ in rows]
    per_step = times(sum(plain, Tally()), 1 / len(plain))
    per_step.trained = round(sum(t.trained for t, _ in rows) / len(rows))
    seen = sum(n for _, n in rows) if len(plain) < len(rows) else 0
    if not seen:
        return per_step, Tally()
    extra = sum((t for t, n in rows if n), Tally()) - times(per_step, len(rows) - len(plain))
    per_eval = rest(Bound(times(extra, 1 / seen)), Tally())
    per_eval.trained = 0
    return per_step, per_eval


def expected(per_step: Tally, per_eval: Tally, steps: int, evals: int) -> Tally:
    """A pilot's measured spend per plain step and per evaluation, scaled to a run of `steps`
    steps and `evals` evaluations."""
    return times(per_step, steps) + times(per_eval, evals)


def times(t: Tally, f: float) -> Tally:
    """`t` scaled by `f` (tokens rounded)."""
    return Tally(prefill=round(t.prefill * f), sampled=round(t.sampled * f),
                 trained=round(t.trained * f), judge_input=round(t.judge_input * f),
                 judge_output=round(t.judge_output * f), wall_s=t.wall_s * f,
                 device_s=t.device_s * f)


def rest(b: Bound, spent: Tally) -> Tally:
    """What a run bounded by `b` may still spend after `spent` (each part at least 0)."""
    left = b.tally - spent
    return Tally(prefill=max(left.prefill, 0), sampled=max(left.sampled, 0),
                 trained=max(left.trained, 0), judge_input=max(left.judge_input, 0),
                 judge_output=max(left.judge_output, 0), wall_s=max(left.wall_s, 0.0),
                 device_s=max(left.device_s, 0.0))


def tokens_text(t: Tally) -> str:
    """'12,345 tokens (prefill 1,000, sampled 10,000, trained 1,345)' (+ judge tokens)."""
    judge = (f", judge {t.judge_input:,} in / {t.judge_output:,} out"
             if t.judge_input or t.judge_output else "")
    return (f"{t.tokens:,} tokens (prefill {t.prefill:,}, sampled {t.sampled:,}, "
            f"trained {t.trained:,}{judge})")


def money_text(t: Tally, prices: Prices, wall_known: bool) -> str:
    """The dollars of `t` ('' with no price); `wall_known`: False for a bound, whose
    device-hours are unknown before the run (named instead of priced at 0)."""
    if not prices.any:
        return ""
    bill = price(t, prices)
    unpriced = [w for w in bill.unpriced if w != "device-hours" or wall_known]
    notes = ([f"{', '.join(unpriced)} unpriced"] if unpriced else []) + (
        ["device-hours not bounded"] if prices.device_hour is not None and not wall_known
        else [])
    return usd_text(bill.usd or 0.0) + (f" ({'; '.join(notes)})" if notes else "")
