"""Test doubles for `retrain serve`: the API key the SDK sends, a bigram engine (numpy,
analytic gradients) and a server running in this process. Shared by the serve, tinker
backend and off-policy tests."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import numpy as np

from retrain.backends.base import AdamParams, Completion, LossOutput, SamplingParams
from retrain.serve.engine import EngineError, SampleResult
from retrain.serve.server import ServerThread
from retrain.serve.tinker.routes import build_app

KEY = "tml-test-not-a-real-key-0123456789"


# ------------------------------------------------------------------------------ engine double


class BigramEngine:
    """A bigram policy per adapter (logits table + Adam), with Tinker loss semantics.

    `calls` records (op, model_id) in execution order; `delay_s` slows each op so tests
    can observe concurrency; `concurrent`/`peak` count engine calls running at once.
    """

    arch = "bigram"

    def __init__(self, vocab: int = 16, eos: int = 1, tokenizer_id: str = "", delay_s: float = 0):
        self.base_model = "bigram-test"
        self.tokenizer_id = tokenizer_id
        self.vocab = vocab
        self.vocab_size = vocab
        self.max_context = 64
        self.eos = eos
        self.delay_s = delay_s
        self.adapters: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.concurrent = 0
        self.peak = 0
        self._lock = threading.Lock()

    def accepts(self, base_model):
        return base_model == self.base_model

    def _enter(self, op, model_id):
        with self._lock:
            self.calls.append((op, model_id))
            self.concurrent += 1
            self.peak = max(self.peak, self.concurrent)
        if self.delay_s:
            time.sleep(self.delay_s)

    def _leave(self):
        with self._lock:
            self.concurrent -= 1

    def create_adapter(self, model_id, rank, seed):
        rng = np.random.default_rng(seed or 0)
        self.adapters[model_id] = {"w": rng.normal(0, 0.1, (self.vocab, self.vocab)),
                                   "g": np.zeros((self.vocab, self.vocab)),
                                   "m": np.zeros((self.vocab, self.vocab)),
                                   "v": np.zeros((self.vocab, self.vocab)), "t": 0,
                                   "rank": rank}

    def drop_adapter(self, model_id):
        self.adapters.pop(model_id, None)

    def _a(self, model_id):
        if model_id not in self.adapters:
            raise EngineError(f"no adapter {model_id}")
        return self.adapters[model_id]

    @staticmethod
    def _logp(w):
        z = w - w.max(axis=-1, keepdims=True)
        return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))

    def forward_backward(self, model_id, data, loss_fn, config, forward_only):
        self._enter("forward_backward", model_id)
        try:
            a = self._a(model_id)
            logp = self._logp(a["w"])
            out, total = [], 0.0
            lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
            for d in data:
                x = np.asarray(d.input_tokens)
                y = np.asarray(d.target_tokens)
                lp = logp[x, y]
                out.append(lp.astype(np.float32))
                ratio = np.exp(lp - np.asarray(d.logprobs))
                adv = np.asarray(d.advantages)
                if loss_fn == "ppo":
                    clipped = np.clip(ratio, lo, hi)
                    obj = np.minimum(ratio * adv, clipped * adv)
                    dlp = np.where(ratio * adv <= clipped * adv, -ratio * adv, 0.0)
                else:
                    obj = ratio * adv
                    dlp = -ratio * adv
                total += float(-obj.sum())
                if not forward_only:
                    p = np.exp(logp[x])
                    grad = -p * dlp[:, None]
                    grad[np.arange(len(x)), y] += dlp
                    np.add.at(a["g"], x, grad)
            return LossOutput(total, out)
        finally:
            self._leave()

    def optim_step(self, model_id, adam: AdamParams):
        self._enter("optim_step", model_id)
        try:
            a = self._a(model_id)
            g = a["g"]
            norm = float(np.sqrt((g * g).sum()))
            if adam.grad_clip_norm > 0 and norm > adam.grad_clip_norm:
                g = g * (adam.grad_clip_norm / norm)
            a["t"] += 1
            a["m"] = adam.beta1 * a["m"] + (1 - adam.beta1) * g
            a["v"] = adam.beta2 * a["v"] + (1 - adam.beta2) * g * g
            mhat = a["m"] / (1 - adam.beta1 ** a["t"])
            vhat = a["v"] / (1 - adam.beta2 ** a["t"])
            a["w"] = a["w"] - adam.learning_rate * mhat / (np.sqrt(vhat) + adam.eps)
            a["g"] = np.zeros_like(g)
            return {"grad_norm:mean": norm}
        finally:
            self._leave()

    def save_state(self, model_id, folder: Path):
        a = self._a(model_id)
        np.savez(folder / "state.npz", w=a["w"], m=a["m"], v=a["v"], t=a["t"])

    def load_state(self, model_id, folder: Path, optimizer):
        a = self._a(model_id)
        z = np.load(folder / ("state.npz" if (folder / "state.npz").exists() else "sampler.npz"))
        a["w"] = z["w"].copy()
        if optimizer:
            a["m"], a["v"], a["t"] = z["m"].copy(), z["v"].copy(), int(z["t"])

    def snapshot(self, model_id):
        return self._a(model_id)["w"].copy()

    def drop_snapshot(self, snap):
        self.dropped = getattr(self, "dropped", 0) + (snap is not None)

    def write_snapshot(self, snap, folder: Path):
        np.savez(folder / "sampler.npz", w=snap)

    def read_snapshot(self, folder: Path):
        name = "state.npz" if (folder / "state.npz").exists() else "sampler.npz"
        return np.load(folder / name)["w"].copy()

    def sample(self, snap, prompt, n, spec: SamplingParams, prompt_logprobs, cancel=None):
        self._enter("sample", "")
        try:
            if cancel is not None and cancel.is_set():
                raise EngineError("sampling cancelled")
            w = snap if snap is not None else np.zeros((self.vocab, self.vocab))
            logp = self._logp(w / max(spec.temperature, 1e-6))
            rng = np.random.default_rng(spec.seed)
            stops = {self.eos, *spec.stop_tokens}
            seqs = []
            for _ in range(n):
                prev, toks, lps, reason = prompt[-1], [], [], "length"
                for _ in range(spec.max_tokens):
                    p = np.exp(logp[prev])
                    tok = int(rng.choice(self.vocab, p=p / p.sum()))
                    toks.append(tok)
                    lps.append(float(logp[prev, tok]))
                    prev = tok
                    if tok in stops:
                        reason = "stop"
                        break
                seqs.append(Completion(toks, lps, reason))
            plp = None
            if prompt_logprobs:
                pairs = zip(prompt, prompt[1:], strict=False)
                plp = [math.nan] + [float(logp[a, b]) for a, b in pairs]
            return SampleResult(seqs, plp)
        finally:
            self._leave()


class Served:
    """A running server plus handles on its engine, service and traffic counters."""

    def __init__(self, engine, tmp_path: Path, **kwargs):
        self.engine = engine
        self.app, self.service = build_app(engine, tmp_path / "serve-state", **kwargs)
        self.thread = ServerThread(self.app)
        self.url = self.thread.url
        self.traffic = self.app.traffic

    def __enter__(self):
        self.thread.__enter__()
        return self

    def __exit__(self, *exc):
        self.thread.__exit__(*exc)
