"""Token accounting (issue 55): the counts each backend keeps (`TokenUsage`) match a hand
count on the tiny model, on the local backend and on the tinker backend against a real
`retrain serve`; each run's rows carry the deltas; the judge's tokens come from the API's own
`usage`, which `retrain serve` reports on every OpenAI route."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from retrain.backends.base import AdamParams, LossConfig, SamplingParams, make_datum  # noqa: E402
from retrain.bill.tally import Tally  # noqa: E402
from tests.conftest import SERVE_KEY  # noqa: E402
from tests.run_helpers import rows, run_in_process, write_config  # noqa: E402

QUESTIONS = ("hi", "what is 2+2?", "count to three please")


def chat_prompts(tokenizer):
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, tokenize=True)["input_ids"]
            for q in QUESTIONS]


def exercise(backend, prompts):
    """Sample 3 per prompt, train on them, ask the reference: the hand count of each part."""
    params = SamplingParams(max_tokens=6, seed=1)
    groups = backend.sample(prompts, 3, params)
    datums = [make_datum(p, c, (-1.0) ** j) for p, g in zip(prompts, groups, strict=True)
              for j, c in enumerate(g)]
    backend.forward_backward(datums, LossConfig())
    backend.optim_step(AdamParams(learning_rate=1e-3))
    backend.reference_logprobs(datums[:2], 1.0)
    return groups, datums


def test_local_backend_counts_what_its_calls_carried(model, tmp_path):
    from retrain.backends.local.backend import LocalBackend

    backend = LocalBackend.new_adapter(model, "usage", lora_rank=4, seed=7,
                                       checkpoint_dir=tmp_path)
    try:
        prompts = chat_prompts(model.tokenizer)
        groups, datums = exercise(backend, prompts)
        usage = backend.token_usage
        # each prompt once per call (not once per completion), and the reference's inputs
        assert usage.prefill == sum(map(len, prompts)) + sum(len(d.input_tokens)
                                                             for d in datums[:2])
        assert usage.sampled == sum(len(c.tokens) for g in groups for c in g) > 0
        assert usage.trained == sum(len(d.input_tokens) for d in datums)
    finally:
        backend.close()
        model.delete_adapter("usage")


def test_tinker_backend_counts_the_ids_its_calls_sent(tiny_server, sdk_env):
    pytest.importorskip("tinker")
    from retrain.backends.tinker.backend import TinkerBackend

    backend = TinkerBackend(base_model="tiny-random", lora_rank=4, seed=0,
                            base_url=tiny_server.url, request_timeout_s=60.0)
    try:
        prompts = chat_prompts(backend.tokenizer)
        groups, datums = exercise(backend, prompts)
        usage = backend.token_usage
        # compute_logprobs sends the whole sequence: the first input token + the targets
        assert usage.prefill == sum(map(len, prompts)) + sum(len(d.input_tokens) + 1
                                                             for d in datums[:2])
        assert usage.sampled == sum(len(c.tokens) for g in groups for c in g) > 0
        assert usage.trained == sum(len(d.input_tokens) for d in datums)
    finally:
        backend.close()


def test_each_row_carries_the_tokens_of_its_step(tmp_path, tiny_model):
    """One prompt repeated, so each step's hand count is plain: batch x its length sent,
    every completion 8 tokens (checked), each trained datum prompt + 8 - 1 tokens."""
    lines = [json.dumps({"prompt": "What is 2 + 3?", "answer": "5"})] * 6
    (tmp_path / "same.jsonl").write_text("\n".join(lines) + "\n")
    path = write_config(tmp_path, data={"source": "jsonl", "path": "same.jsonl",
                                        "eval_size": 0}, training={"max_steps": 3})
    done = run_in_process([path], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    from transformers import AutoTokenizer

    from retrain.config.loader import load_config
    from retrain.environments.answers import Problem
    from retrain.environments.tasks import render_prompt

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    n_prompt = len(render_prompt(tokenizer, Problem(prompt="What is 2 + 3?", answer="5"),
                                 load_config(path).data))
    got = rows(tmp_path / "logs" / "run")
    assert [r["step"] for r in got] == [1, 2, 3]
    for r in got:
        assert r["max_token_hit_rate"] == 1.0  # the hand count below assumes 8-token replies
        assert r["prefill_tokens"] == r["batch_size"] * n_prompt
        assert r["sampled_tokens"] == r["num_completions"] * 8
        assert r["trained_tokens"] == r["trained_completions"] * (n_prompt + 8 - 1)
        assert r["judge_input_tokens"] == r["judge_output_tokens"] == 0
        assert r["wall_s"] >= r["step_time_s"] > 0
    assert Tally.of_rows(got).tokens == sum(r["prefill_tokens"] + r["sampled_tokens"]
                                            + r["trained_tokens"] for r in got)


def test_serve_reports_usage_on_every_openai_route(tiny_serve, tiny_model):
    """chat and completions, plain and streamed with include_usage: the prompt's tokens as
    the server rendered them, and the tokens it sampled."""
    import openai
    from transformers import AutoTokenizer

    from retrain.results.sample import render

    client = openai.OpenAI(base_url=f"{tiny_serve.url}/v1", api_key=SERVE_KEY, max_retries=0)
    try:
        prompt = [5, 77, 104, 101, 108, 108, 111]
        kw = {"model": "tiny-random", "max_tokens": 6, "temperature": 0}
        plain = client.completions.create(prompt=prompt, logprobs=0, **kw)
        assert plain.usage.prompt_tokens == len(prompt)
        assert plain.usage.completion_tokens == len(plain.choices[0].logprobs.tokens) > 0
        streamed = list(client.completions.create(prompt=prompt, stream=True,
                                                  stream_options={"include_usage": True}, **kw))
        assert streamed[-1].usage == plain.usage
        messages = [{"role": "user", "content": "hello there"}]
        chat = client.chat.completions.create(messages=messages, **kw)
        rendered = render(AutoTokenizer.from_pretrained(tiny_model), messages, True)
        assert chat.usage.prompt_tokens == len(rendered)
        assert 0 < chat.usage.completion_tokens <= 6
        chunks = list(client.chat.completions.create(messages=messages, stream=True,
                                                     stream_options={"include_usage": True},
                                                     **kw))
        assert chunks[-1].usage == chat.usage
    finally:
        client.close()


def test_judge_tokens_are_the_apis_usage(tiny_serve, tiny_model, tmp_path, monkeypatch):
    """A judge scorer against `retrain serve`: its metrics carry the prompt tokens of each
    request as served (a hand count of the chat-rendered request) and the tokens it wrote."""
    from transformers import AutoTokenizer

    from retrain.config.sections import from_dict
    from retrain.environments.answers import Problem
    from retrain.environments.judge.prompt import pointwise_request
    from retrain.environments.judge.reward import JudgeScorer
    from retrain.results.sample import render

    monkeypatch.setenv("SERVE_JUDGE_KEY", SERVE_KEY)
    table = {"base_url": f"{tiny_serve.url}/v1", "model": "tiny-random", "max_tokens": 5,
             "api_key_env": "SERVE_JUDGE_KEY", "retries": 0, "timeout_s": 60.0}
    scorer = JudgeScorer(from_dict({"reward": {"type": "judge", "judge": table}}).reward,
                         tmp_path)
    try:
        problem = Problem(prompt="What is 3 + 4?", answer="7")
        scores = scorer.score(["7", "eight"], [problem, problem])
    finally:
        scorer.close()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    sent = [render(tokenizer, [{"role": "user", "content": pointwise_request(
        scorer.rubric, problem.prompt, text, problem.answer)}], True) for text in ("7", "eight")]
    assert scores.metrics["judge_calls"] == 2 and scores.metrics["judge_errors"] == 0
    assert scores.metrics["judge_input_tokens"] == sum(map(len, sent))
    assert 2 <= scores.metrics["judge_output_tokens"] <= 2 * 5
