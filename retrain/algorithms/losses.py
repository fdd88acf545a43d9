"""The policy losses: their names, what each reads, its knobs and their bounds. Pure: the
tensor math lives in `backends/local/training/policy_losses.py`, the normaliser in `aggregation`.

Every loss is the Tinker documentation's (tinker-docs.thinkingmachines.ai/tinker/losses, one
page per loss): a per-token loss, summed over a datum's positions. r = p/q is the importance
ratio of the trainer's log-prob log p to the sampler's log q; A the advantage:

    importance_sampling  -r A
    ppo                  -min(r A, clip(r, lo, hi) A); dual clip (not Tinker's): a token of
                         A < 0 loses at most c |A|
    cispo                -sg(clip(r, lo, hi)) log p A
    gspo                 -min(s_t A, clip(s_t, lo, hi) A), s_t = sg(s) p / sg(p): every token
                         carries its sequence's ratio s = exp(mean of log r over the sequence)
                         with its own log-prob's gradient (GSPO-token)
    dro                  -(log p A - beta/2 (log p - log q)^2)
    cross_entropy        -w log p (w = the token weights; for RL datums, the advantages)

`lo`/`hi` are absolute ratio bounds (Tinker's `clip_low_threshold`/`clip_high_threshold`);
the TOML names them relative to 1: lo = 1 - clip_eps, hi = 1 + clip_eps_high.
"""

from __future__ import annotations

# The pinned SDK's LossFnType (tinker/types/loss_fn_type.py, 0.38.0), in its order.
TINKER_LOSS_FN_TYPES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo",
                        "stable_reinforce", "custom")

# Losses the local backend and `retrain serve` compute (the tinker backend sends all but dro).
LOSSES = ("importance_sampling", "ppo", "cispo", "gspo", "dro", "cross_entropy")

# Tinker names retrain cannot compute, and why (one line each).
UNSUPPORTED = {
    "stable_reinforce": "Tinker has not published stable_reinforce's formula, and it reads "
                        "stability information its sampler records (record_stability_info); "
                        "use ppo, cispo or gspo for off-policy stability",
    "custom": "custom is Tinker's API for a loss graph a client uploads "
              "(create_custom_loss), not a built-in loss; pick a built-in one",
}

# Why the tinker backend does not send dro: the local update cannot be expressed in its inputs.
DRO_ON_TINKER = ("Tinker's dro penalises every position of a datum, the prompt's too (it "
                 "reads no mask), so it cannot make the local update; use the local backend "
                 "or another loss")

CLIPPED = ("ppo", "cispo", "gspo")
# Each clipped loss's default bounds (lo, hi): ppo's and cispo's from their Tinker pages (cispo
# clips only above); the gspo page's default could not be read, so gspo takes ppo's.
DEFAULT_THRESHOLDS = {"ppo": (0.8, 1.2), "gspo": (0.8, 1.2), "cispo": (0.0, 4.0)}
# dro's beta when none is given: the value of the Tinker page's example (it names no default).
DEFAULT_DRO_BETA = 0.05

# The per-datum loss_fn_inputs each loss reads on the wire (Tinker's names).
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages", "sequence_ratio_mask"),
}

# The loss_fn_config keys each loss reads (Tinker's names; `temperature` is retrain's own:
# the trainer's log-probs are taken at the sampler's temperature).
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    **{name: ("temperature",) for name in LOSSES},
    **{name: ("clip_low_threshold", "clip_high_threshold", "temperature") for name in CLIPPED},
    "dro": ("beta", "temperature"),
}


def thresholds(name: str, clip_eps: float | None, clip_eps_high: float | None
               ) -> tuple[float, float]:
    """The clip bounds (lo, hi) of a clipped loss: 1 - clip_eps and 1 + clip_eps_high, each
    the loss's documented default where None."""
    lo, hi = DEFAULT_THRESHOLDS.get(name, (0.8, 1.2))
    return (lo if clip_eps is None else 1.0 - clip_eps,
            hi if clip_eps_high is None else 1.0 + clip_eps_high)


def unknown_loss(name: str) -> str:
    """Why `name` is no loss retrain computes (a Tinker name it refuses, or no name at all)."""
    if name in UNSUPPORTED:
        return f"loss {name!r} is not supported: {UNSUPPORTED[name]}"
    return f"unknown loss {name!r}; use one of {', '.join(LOSSES)}"


def wire_config_problem(name: str, config: dict[str, float]) -> str | None:
    """What is wrong with a loss_fn_config for loss `name` (None: nothing): keys the loss does
    not read, and bounds that make no loss (lo <= hi, beta >= 0)."""
    allowed = CONFIG_KEYS[name]
    extra = sorted(set(config) - set(allowed))
    if extra:
        return (f"loss_fn_config key(s) {', '.join(map(repr, extra))} are not read by loss "
                f"{name!r}; it takes {', '.join(allowed)}")
    lo = config.get("clip_low_threshold", DEFAULT_THRESHOLDS.get(name, (0.0, 0.0))[0])
    hi = config.get("clip_high_threshold", DEFAULT_THRESHOLDS.get(name, (0.0, 0.0))[1])
    if not 0 <= lo <= hi:
        return (f"loss_fn_config: need 0 <= clip_low_threshold <= clip_high_threshold, "
                f"got {lo} and {hi}")
    if config.get("beta", 0.0) < 0:
        return f"loss_fn_config['beta'] must be >= 0, got {config['beta']}"
    return None


def config_problems(algorithm, backend: str) -> list[tuple[str, str]]:
    """Combinations of [algorithm] keys (and the backend) that make no loss: (key, message)
    pairs for `config.cross_checks`. `algorithm` is the AlgorithmConfig section."""
    a, out = algorithm, []
    if a.loss in UNSUPPORTED:
        out.append(("algorithm.loss", unknown_loss(a.loss)))
    c = a.clip_ratio_c
    if c and a.loss != "ppo":
        out.append(("algorithm.clip_ratio_c", f"is ppo's dual clip; loss = {a.loss!r} has "
                    "none: set it to 0 or use loss = 'ppo'"))
    elif c and c <= 1:
        out.append(("algorithm.clip_ratio_c", f"must be > 1 (3 is usual) or 0 = off, got {c}"))
    elif c and backend == "tinker":
        out.append(("algorithm.clip_ratio_c", "Tinker's ppo has no dual clip: set it to 0 "
                    "with backend = 'tinker'"))
    if a.loss == "dro" and backend == "tinker":
        out.append(("algorithm.loss", f"= 'dro' on backend = 'tinker': {DRO_ON_TINKER}"))
    return out


_SHAPES = {
    "importance_sampling": "-ratio x A",
    "ppo": "-min(ratio x A, clip(ratio) x A)",
    "cispo": "-sg(clip(ratio)) x log p x A",
    "gspo": "-min(s x A, clip(s) x A), s = the sequence's ratio",
    "dro": "-(log p x A - beta/2 x (log p - log q)^2)",
    "cross_entropy": "-A x log p (REINFORCE, no ratio)",
}


def describe(algorithm) -> str:
    """One line for `explain`: the loss, its formula and knobs, and the aggregation."""
    a = algorithm
    if a.loss not in _SHAPES:
        return f"{a.loss} (not supported)"
    knobs = []
    if a.loss in CLIPPED:
        lo, hi = thresholds(a.loss, eps_of(a.clip_eps), eps_of(a.clip_eps_high))
        knobs.append(f"clip [{lo:g}, {hi:g}]")
    if a.loss == "ppo" and a.clip_ratio_c:
        knobs.append(f"dual clip {a.clip_ratio_c:g}")
    if a.loss == "dro":
        knobs.append(f"beta {a.dro_beta:g}")
    return (f"{a.loss}: {_SHAPES[a.loss]}" + (f", {', '.join(knobs)}" if knobs else "")
            + f"; {a.loss_aggregation}")


def eps_of(value: float | str) -> float | None:
    """A TOML clip key's value: a number, or None for "auto" (the loss's default)."""
    return None if value == "auto" else float(value)
