"""What a seeded OpenAI request of `retrain serve` may count on, and what each reply says of
it: in float32 six identical seeded chat requests decoded together (and beside another request)
give the answer the request gets alone, and the reply says so (`seed_batch_invariant`, the dtype
in `system_fingerprint`); a bfloat16 server says its seeds reach no further than the batch."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("torch")

from retrain.serve.openai.routes import OpenAIServing  # noqa: E402
from tests.run_helpers import wait_until  # noqa: E402
from tests.serve_doubles import Served  # noqa: E402

SEEDED = {"model": "tiny-random", "messages": [{"role": "user", "content": "Tell a story"}],
          "max_tokens": 24, "temperature": 1.0, "seed": 7}


def _served(engine, tmp_path) -> Served:
    serving = OpenAIServing(engine.model.tokenizer, frozenset(engine.model.eos_ids))
    return Served(engine, tmp_path, openai=serving)


def test_float32_seeded_answers_do_not_depend_on_the_batch(tiny_engine, tmp_path):
    with _served(tiny_engine, tmp_path) as served, ThreadPoolExecutor(7) as pool, \
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0) as client:
        alone = client.chat.completions.create(**SEEDED)
        with tiny_engine.model.lock:  # the model is busy: all seven queue up together
            together = [pool.submit(client.chat.completions.create, **SEEDED)
                        for _ in range(6)]
            other = pool.submit(client.chat.completions.create, **{**SEEDED, "seed": 8})
            wait_until(lambda: [len(q) for q in list(tiny_engine._queued.values())] == [7],
                       60, "seven requests queued as one batch")
        answers = [f.result(timeout=120) for f in together]
        other.result(timeout=120)
    assert [a.choices[0].message.content for a in answers] == \
        [alone.choices[0].message.content] * 6
    assert alone.system_fingerprint == "retrain-float32"
    assert alone.model_extra["seed_batch_invariant"] is True


def test_a_bfloat16_server_says_its_seeds_do_not_reach_past_the_batch(tiny_model, tmp_path):
    from retrain.backends.local.model import LocalModel
    from retrain.serve.local_engine import LocalEngine

    engine = LocalEngine(LocalModel.load(tiny_model, "bfloat16", "cpu", 1), "tiny-random")
    with _served(engine, tmp_path) as served, \
            openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0) as client:
        reply = client.chat.completions.create(**SEEDED)
        chunks = list(client.chat.completions.create(**SEEDED, stream=True))
    assert reply.system_fingerprint == "retrain-bfloat16"
    assert reply.model_extra["seed_batch_invariant"] is False
    assert {c.system_fingerprint for c in chunks} == {"retrain-bfloat16"}
