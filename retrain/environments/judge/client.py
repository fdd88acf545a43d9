"""One judge request over the official `openai` SDK: retries with backoff on 429, 5xx and no
answer, the concurrency slot held only while a request is in flight (never while backing
off; in a campaign, a slot of the budget every run shares: `slots.judge_slots`), and the
start-up probe that fails a run whose judge cannot be reached.

The API key is read from the variable `api_key_env` names, only here, and never stored
anywhere but the SDK client in memory.
"""

from __future__ import annotations

import os
import random
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from retrain.config.judge_section import JudgeConfig
from retrain.environments.rewards import clip_message
from retrain.errors import UserError
from retrain.slots.judge_slots import judge_slots_from_env

BACKOFF_CAP_S = 8.0
PROBE_TIMEOUT_S = 10.0


@dataclass
class Answer:
    text: str | None      # None: no usable answer after the retries
    error: str = ""
    calls: int = 0        # HTTP requests sent for it, retries included
    input_tokens: int = 0   # the API's own `usage` of its replies (0 where it reports none)
    output_tokens: int = 0


def _openai() -> Any:
    try:
        import openai
    except ImportError:
        raise UserError("reward.type = 'judge' needs the openai SDK: pip install "
                        "'retrain[judge]'") from None
    return openai


def api_key(cfg: JudgeConfig) -> str:
    """The key from $api_key_env; a placeholder for a judge that takes none."""
    if not cfg.api_key_env:
        return "no-key"  # the SDK insists on a key; keyless servers ignore it
    key = os.environ.get(cfg.api_key_env, "")
    if not key:
        raise UserError(f"reward.judge.api_key_env = {cfg.api_key_env!r}: the variable is not "
                        "set; export it with the judge's API key")
    return key


class JudgeClient:
    """Sends one prompt to the judge and returns its reply text (never raises)."""

    def __init__(self, cfg: JudgeConfig, slot: AbstractContextManager | None = None):
        self.cfg = cfg
        self._openai = _openai()
        self.client = self._openai.OpenAI(base_url=cfg.base_url, api_key=api_key(cfg),
                                          max_retries=0, timeout=cfg.timeout_s)
        if slot is None:
            slot = judge_slots_from_env(cfg.max_concurrent)
        self._slot = slot if slot is not None else threading.BoundedSemaphore(
            cfg.max_concurrent)

    def probe(self) -> None:
        """UserError naming the key and the fix when the judge cannot serve this run: nothing
        answers at base_url, it refuses the key, base_url is not its OpenAI route (a missing
        /v1: /models and /chat/completions both 404), or it does not serve `model`. A model
        /models does not list, or a judge without /models, costs one 1-token request."""
        o, url = self._openai, self.cfg.base_url
        client = self.client.with_options(timeout=min(PROBE_TIMEOUT_S, self.cfg.timeout_s))
        try:
            listed = [str(m.id) for m in client.models.list()]
        except o.AuthenticationError:
            raise UserError(self._refused_key()) from None
        except o.APIConnectionError as exc:  # timeouts included
            raise UserError(f"reward.judge.base_url = {url}: the judge cannot be reached "
                            f"({type(exc).__name__}); start it or fix the URL") from None
        except o.APIStatusError as exc:
            if exc.status_code in (404, 405):  # no /models here: is there a judge at all?
                self._probe_request(client, None)
            return  # it answered otherwise: the run's counted failures will say more
        except Exception:  # a /models body the SDK cannot read: nothing to check against
            return
        if self.cfg.model not in listed:  # some servers (llama.cpp's) take any name
            self._probe_request(client, listed)

    def _probe_request(self, client: Any, listed: list[str] | None) -> None:
        """One 1-token request with the configured model; a UserError when the route or the
        model is refused (`listed`: the models /models lists; None: it has no /models)."""
        o, url = self._openai, self.cfg.base_url
        try:
            with self._slot:
                client.chat.completions.create(
                    model=self.cfg.model, messages=[{"role": "user", "content": "Say OK."}],
                    max_tokens=1, temperature=0.0)
        except o.AuthenticationError:
            raise UserError(self._refused_key()) from None
        except o.APIStatusError as exc:
            said = clip_message(getattr(exc, "message", "") or str(exc), 120)
            if listed is None and exc.status_code in (404, 405):
                raise UserError(
                    f"reward.judge.base_url = {url}: HTTP {exc.status_code} at {url}/models "
                    f"and at {url}/chat/completions ({said}): this is not the judge's "
                    "OpenAI-compatible route; set base_url to it (it usually ends in /v1"
                    f"{'' if url.rstrip('/').endswith('/v1') else ': ' + _with_v1(url)}) "
                    "and check reward.judge.model") from None
            if listed is not None and exc.status_code in (400, 404):
                shown = ", ".join(repr(m) for m in listed[:8]) + (" ..." if len(listed) > 8
                                                                  else "")
                raise UserError(
                    f"reward.judge.model = {self.cfg.model!r}: the judge at {url} does not "
                    f"serve it (HTTP {exc.status_code}: {said}); it lists "
                    f"{shown or 'no models'}: set reward.judge.model to one of them") from None
        except Exception:  # no answer in time, a 5xx, an unreadable body: not settled here
            return

    def _refused_key(self) -> str:
        return (f"reward.judge.base_url = {self.cfg.base_url}: the judge refused the API key "
                f"(from ${self.cfg.api_key_env or '<none>'})")

    def ask(self, prompt: str) -> Answer:
        o, out = self._openai, Answer(text=None)
        for attempt in range(self.cfg.retries + 1):
            wait = 0.0
            try:
                with self._slot:
                    out.calls += 1
                    reply = self.client.chat.completions.create(
                        model=self.cfg.model, messages=[{"role": "user", "content": prompt}],
                        temperature=self.cfg.temperature, max_tokens=self.cfg.max_tokens)
                out.text, out.error = _content(reply), ""
                out.input_tokens, out.output_tokens = _usage(reply)
                return out
            except o.APIStatusError as exc:
                out.error = f"HTTP {exc.status_code}: {clip_message(str(exc), 160)}"
                if exc.status_code != 429 and exc.status_code < 500:
                    return out  # a request the judge will never take
                wait = _retry_after(exc)
            except o.APIConnectionError as exc:
                out.error = f"{type(exc).__name__}: {clip_message(str(exc), 160)}"
            except Exception as exc:  # a reply the SDK cannot read: not worth retrying
                out.error = f"{type(exc).__name__}: {clip_message(str(exc), 160)}"
                return out
            if attempt < self.cfg.retries:
                time.sleep(wait or backoff(attempt))
        return out

    def close(self) -> None:
        self.client.close()


def _with_v1(url: str) -> str:
    return url.rstrip("/") + "/v1"


def _content(reply: Any) -> str:
    """The reply's text; '' when it has none (counted as unparseable, not as an error)."""
    try:
        return reply.choices[0].message.content or ""
    except (AttributeError, IndexError, TypeError):
        return ""


def _usage(reply: Any) -> tuple[int, int]:
    """(prompt, completion) tokens of the reply's `usage`; zeros where the API sent none."""
    usage = getattr(reply, "usage", None)
    counts = (getattr(usage, "prompt_tokens", 0), getattr(usage, "completion_tokens", 0))
    return tuple(c if isinstance(c, int) and c >= 0 else 0 for c in counts)  # type: ignore


def backoff(attempt: int) -> float:
    """Exponential backoff with jitter: about 0.25 s, 0.5 s, 1 s, ... up to BACKOFF_CAP_S."""
    return min(BACKOFF_CAP_S, 0.25 * 2 ** attempt) * random.uniform(0.5, 1.0)


def _retry_after(exc: Any) -> float:
    try:
        return min(BACKOFF_CAP_S, max(0.0, float(exc.response.headers.get("retry-after", 0))))
    except (AttributeError, TypeError, ValueError):
        return 0.0
