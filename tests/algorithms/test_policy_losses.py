"""The policy losses (backends/local/training/policy_losses.py, named in
algorithms/losses.py): values and gradients against a plain per-token loop written here in
float64 (the Tinker documentation's formulas, derivatives by hand), under every aggregation;
and their properties."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from retrain.algorithms import losses  # noqa: E402
from retrain.algorithms.aggregation import AGGREGATIONS, SUM, normaliser  # noqa: E402
from retrain.backends.base import LossConfig  # noqa: E402
from retrain.backends.local.training.policy_losses import RatioStats, token_losses  # noqa: E402

settings.register_profile("retrain", deadline=None, max_examples=200)
settings.load_profile("retrain")

MAX_TOKENS = 7
CONFIGS = {
    "importance_sampling": LossConfig("importance_sampling"),
    "ppo": LossConfig("ppo"),
    "ppo-clip-higher": LossConfig("ppo", clip_eps=0.1, clip_eps_high=0.28),
    "ppo-dual-clip": LossConfig("ppo", clip_ratio_c=1.5),
    "cispo": LossConfig("cispo"),
    "cispo-two-sided": LossConfig("cispo", clip_eps=0.2, clip_eps_high=0.2),
    "gspo": LossConfig("gspo", clip_eps=0.05, clip_eps_high=0.1),
    "dro": LossConfig("dro", dro_beta=0.3),
    "cross_entropy": LossConfig("cross_entropy"),
    # truncated importance sampling (the fast sampler's cap), composed with each ratio loss
    "importance_sampling-capped": LossConfig("importance_sampling", ratio_cap=1.3),
    "ppo-capped": LossConfig("ppo", clip_ratio_c=1.5, ratio_cap=1.1),
    "cispo-capped": LossConfig("cispo", ratio_cap=1.3),
    "gspo-capped": LossConfig("gspo", clip_eps=0.05, clip_eps_high=0.1, ratio_cap=1.02),
}

# A token: (trainer log-prob, sampler log-prob, advantage, counts in its gspo sequence ratio)
token = st.tuples(st.floats(-4.0, -0.01), st.floats(-0.8, 0.8), st.floats(-2.0, 2.0),
                  st.booleans()).map(lambda t: (t[0], t[0] - t[1], t[2], t[3]))
sequences = st.lists(st.lists(token, min_size=1, max_size=6), min_size=1, max_size=5)


# ------------------------------------------------------------------ the plain reference


def reference_token(loss: LossConfig, new: float, old: float, adv: float, s: float
                    ) -> tuple[float, float]:
    """(loss, d loss / d new) of one token, from the formulas; `s` is gspo's sequence ratio."""
    lo, hi = loss.thresholds
    r = s if loss.name == "gspo" else math.exp(new - old)
    if loss.ratio_cap:   # counts at most the cap, its gradient cap x d(new) where it binds
        r = min(r, loss.ratio_cap)
    inside = lo < r < hi
    clip = min(max(r, lo), hi)
    if loss.name == "cross_entropy":
        return -adv * new, -adv
    if loss.name == "importance_sampling":
        return -r * adv, -r * adv
    if loss.name in ("ppo", "gspo"):
        if r * adv <= clip * adv:
            value, grad = -r * adv, -r * adv
        else:
            value, grad = -clip * adv, (-r * adv if inside else 0.0)
        c = loss.clip_ratio_c
        if c and adv < 0 and -c * adv < value:
            value, grad = -c * adv, 0.0
        return value, grad
    if loss.name == "cispo":
        return -clip * new * adv, -clip * adv
    if loss.name == "dro":
        b = loss.dro_beta
        return -(new * adv - 0.5 * b * (new - old) ** 2), -(adv - b * (new - old))
    raise AssertionError(loss.name)


def reference_scales(seqs, how: str) -> list[float]:
    """Each sequence's factor on its token losses, from the aggregation's definition."""
    n_tokens = sum(len(s) for s in seqs)
    if how == "token_mean":
        return [1.0 / n_tokens] * len(seqs)
    if how == "sequence_mean":
        return [1.0 / (len(seqs) * len(s)) for s in seqs]
    if how == "constant":
        return [1.0 / (MAX_TOKENS * len(seqs))] * len(seqs)
    return [1.0] * len(seqs)


def reference(seqs, loss: LossConfig, how: str) -> tuple[float, list[float]]:
    total, grads = 0.0, []
    for seq, scale in zip(seqs, reference_scales(seqs, how), strict=True):
        counted = [new - old for new, old, _, in_ratio in seq if in_ratio]
        s = math.exp(sum(counted) / len(counted)) if counted else 1.0
        for new, old, adv, _ in seq:
            value, grad = reference_token(loss, new, old, adv, s)
            total += scale * value
            grads.append(scale * grad)
    return total, grads


# ------------------------------------------------------------------ the implementation


def flat(seqs, dtype=torch.float64):
    new = torch.tensor([t[0] for s in seqs for t in s], dtype=dtype, requires_grad=True)
    old = torch.tensor([t[1] for s in seqs for t in s], dtype=dtype)
    adv = torch.tensor([t[2] for s in seqs for t in s], dtype=dtype)
    seq = torch.tensor([i for i, s in enumerate(seqs) for _ in s])
    in_ratio = torch.tensor([t[3] for s in seqs for t in s])
    return new, old, adv, seq, in_ratio


def implementation(seqs, loss: LossConfig, how: str):
    new, old, adv, seq, in_ratio = flat(seqs)
    norm = normaliser([len(s) for s in seqs], how, MAX_TOKENS)
    weights = torch.tensor([norm.weights[i] for i, s in enumerate(seqs) for _ in s],
                           dtype=torch.float64)
    terms = token_losses(new, old, adv, loss, seq, in_ratio)
    total = (terms.loss * weights).sum() / norm.denominator
    total.backward()
    return float(total.detach()), new.grad.tolist(), terms


@pytest.mark.parametrize("how", [*AGGREGATIONS, SUM])
@pytest.mark.parametrize("name", list(CONFIGS))
@settings(max_examples=25)
@given(seqs=sequences)
def test_value_and_gradient_equal_the_per_token_loop(name, how, seqs):
    loss = CONFIGS[name]
    want, want_grad = reference(seqs, loss, how)
    got, got_grad, _ = implementation(seqs, loss, how)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-6)
    assert got_grad == pytest.approx(want_grad, rel=1e-6, abs=1e-6)


def test_every_loss_is_tested_and_named_as_the_sdk_names_it():
    from tinker.types.loss_fn_type import LossFnType

    assert set(losses.TINKER_LOSS_FN_TYPES) == set(LossFnType.__args__)
    assert set(losses.LOSSES) | set(losses.UNSUPPORTED) == set(losses.TINKER_LOSS_FN_TYPES)
    assert {c.name for c in CONFIGS.values()} == set(losses.LOSSES) == set(losses.INPUTS)


# ------------------------------------------------------------------ properties


@settings(max_examples=50)
@given(seqs=sequences)
def test_at_ratio_one_ppo_cispo_gspo_and_importance_sampling_share_the_gradient(seqs):
    on_policy = [[(new, new, adv, r) for new, _, adv, r in s] for s in seqs]
    grads = {name: implementation(on_policy, CONFIGS[name], "token_mean")[1]
             for name in ("importance_sampling", "ppo", "ppo-clip-higher", "cispo", "gspo")}
    for grad in grads.values():
        assert grad == pytest.approx(grads["importance_sampling"], abs=1e-12)


@settings(max_examples=50)
@given(seqs=sequences)
def test_clip_fraction_is_zero_and_the_ratio_one_on_policy(seqs):
    on_policy = [[(new, new, adv, r) for new, _, adv, r in s] for s in seqs]
    for name in ("ppo", "cispo", "gspo", "importance_sampling", "dro"):
        stats = RatioStats()
        stats.add(implementation(on_policy, CONFIGS[name], "token_mean")[2])
        assert stats.metrics() == {"clip_fraction": 0.0, "ratio_mean": pytest.approx(1.0),
                                   "ratio_max": pytest.approx(1.0)}


@settings(max_examples=50)
@given(tokens=st.lists(token, min_size=1, max_size=8), how=st.sampled_from(AGGREGATIONS))
def test_gspo_on_one_token_sequences_is_ppo(tokens, how):
    seqs = [[(new, old, adv, True)] for new, old, adv, _ in tokens]
    ppo = LossConfig("ppo", clip_eps=0.05, clip_eps_high=0.1)
    got, got_grad, _ = implementation(seqs, CONFIGS["gspo"], how)
    want, want_grad, _ = implementation(seqs, ppo, how)
    assert got == pytest.approx(want, abs=1e-12)
    assert got_grad == pytest.approx(want_grad, abs=1e-12)


def test_clip_fraction_counts_ratios_outside_the_range():
    seqs = [[(-1.0, -1.0 - math.log(1.5), 1.0, True), (-1.0, -1.0, 1.0, True),
             (-1.0, -1.0 - math.log(0.5), -1.0, True), (-2.0, -2.0 - math.log(1.1), 1.0, True)]]
    stats = RatioStats()
    stats.add(implementation(seqs, CONFIGS["ppo"], "token_mean")[2])
    m = stats.metrics()
    assert m["clip_fraction"] == 0.5 and m["ratio_max"] == pytest.approx(1.5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 1.0 + 0.5 + 1.1) / 4)


def test_dual_clip_caps_a_negative_advantage_token_and_stops_its_gradient():
    seqs = [[(0.0, -math.log(4.0), -1.0, True)]]          # ratio 4 > c = 3, A < 0
    got, grad, _ = implementation(seqs, LossConfig("ppo", clip_ratio_c=3.0), SUM)
    assert got == pytest.approx(3.0) and grad == [0.0]
    plain, plain_grad, _ = implementation(seqs, LossConfig("ppo"), SUM)
    assert plain == pytest.approx(4.0) and plain_grad == [pytest.approx(4.0)]


def test_the_ratio_cap_counts_the_tokens_it_cut_and_reports_the_ratio_before():
    seqs = [[(0.0, -math.log(3.0), 1.0, True), (-1.0, -1.0, 1.0, True)]]   # ratios 3 and 1
    got, grad, terms = implementation(seqs, LossConfig("importance_sampling", ratio_cap=2.0),
                                      SUM)
    assert got == pytest.approx(-3.0) and grad == [pytest.approx(-2.0), pytest.approx(-1.0)]
    stats = RatioStats()
    stats.add(terms)
    assert stats.metrics() == {"clip_fraction": 0.0, "ratio_mean": pytest.approx(2.0),
                               "ratio_max": pytest.approx(3.0), "ratio_truncated": 0.5}
    plain = RatioStats()
    plain.add(implementation(seqs, CONFIGS["importance_sampling"], SUM)[2])
    assert "ratio_truncated" not in plain.metrics()


def test_documented_defaults():
    assert LossConfig("ppo").thresholds == (0.8, 1.2)
    assert LossConfig("cispo").thresholds == (0.0, 4.0)          # Tinker: no lower bound
    assert LossConfig("ppo", clip_eps=0.1, clip_eps_high=0.28).thresholds == (0.9, 1.28)


def test_unknown_loss_is_a_clear_error():
    with pytest.raises(ValueError, match="stable_reinforce.*not published"):
        token_losses(torch.zeros(1), torch.zeros(1), torch.zeros(1),
                     LossConfig("stable_reinforce"))


# ------------------------------------------------------------------ the TOML


BAD = {
    "stable_reinforce": ({"algorithm": {"loss": "stable_reinforce"}}, "algorithm.loss",
                         "not published"),
    "custom": ({"algorithm": {"loss": "custom"}}, "algorithm.loss", "create_custom_loss"),
    "dual clip off ppo": ({"algorithm": {"loss": "cispo", "clip_ratio_c": 3.0}},
                          "algorithm.clip_ratio_c", "ppo's dual clip"),
    "dual clip <= 1": ({"algorithm": {"loss": "ppo", "clip_ratio_c": 0.5}},
                       "algorithm.clip_ratio_c", "> 1"),
    "dual clip on tinker": ({"algorithm": {"loss": "ppo", "clip_ratio_c": 3.0},
                             "backend": {"backend": "tinker"}}, "algorithm.clip_ratio_c",
                            "Tinker"),
    "dro on tinker": ({"algorithm": {"loss": "dro"}, "backend": {"backend": "tinker"}},
                      "algorithm.loss", "prompt"),
    "aggregation typo": ({"algorithm": {"loss_aggregation": "token-mean"}},
                         "algorithm.loss_aggregation", "did you mean 'token_mean'"),
    "clip word typo": ({"algorithm": {"clip_eps": "atuo"}}, "algorithm.clip_eps",
                       "did you mean 'auto'"),
    "clip bound": ({"algorithm": {"clip_eps": 1.5}}, "algorithm.clip_eps", "<= 1"),
    "beta bound": ({"algorithm": {"dro_beta": -1}}, "algorithm.dro_beta", ">= 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_loss_settings_are_refused_in_one_line_naming_the_key(case, tmp_path, capsys):
    from retrain.cli.app import run_app
    from retrain.config import toml_io

    raw, key, words = BAD[case]
    path = tmp_path / "run.toml"
    path.write_text(toml_io.dumps(raw), encoding="utf-8")
    for args in (["explain", str(path)], [str(path)]):
        assert run_app(args) != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and key in err and words in err, err


def test_every_loss_name_is_a_toml_choice_and_explain_shows_its_knobs(tmp_path):
    from retrain.cli.explain import dry_run as explain
    from retrain.config import sections

    assert sections.section_fields("algorithm")["loss"].metadata["choices"] == \
        losses.TINKER_LOSS_FN_TYPES
    path = tmp_path / "run.toml"
    path.write_text('[algorithm]\nloss = "cispo"\nloss_aggregation = "constant"\n'
                    '[training]\nmax_tokens = 64\n', encoding="utf-8")
    line = explain.build_report(path).settings["loss"]
    assert line.startswith("cispo:") and "clip [0, 4]" in line and "constant" in line
    path.write_text('[algorithm]\nloss = "ppo"\nclip_eps_high = 0.28\nclip_ratio_c = 3\n',
                    encoding="utf-8")
    line = explain.build_report(path).settings["loss"]
    assert "clip [0.8, 1.28], dual clip 3; token_mean" in line
