"""lm-evaluation-harness's `local-completions` model against a real `retrain serve` process,
offline: a multiple-choice task (loglikelihood: `echo` with the prompt's log-probs on
/v1/completions) and a `generate_until` task, each defined in a local YAML over a local JSONL,
for the base model and an `--adapter`. lm-eval's scores are the server's own numbers: its
log-likelihoods are the sums of the prompt log-probs the Tinker SDK (the base model) and the
engine's Tinker path (the adapter) give for the same tokens; its generations are the greedy text
of the Tinker SDK (base) and of `retrain eval` (the adapter)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval")
tinker = pytest.importorskip("tinker")
pytest.importorskip("torch")

from tinker import types  # noqa: E402

from retrain.backends.base import SamplingParams  # noqa: E402
from retrain.cli.app import run_app  # noqa: E402
from retrain.serve.checkpoints import CheckpointStore  # noqa: E402
from retrain.serve.openai.adapters import AdapterSpec, find_runs, load_adapters  # noqa: E402
from tests.run_helpers import serve_process, write_config  # noqa: E402

CHOICES = [{"question": "2 + 2 =", "choices": ["4", "5", "22"], "answer": 0},
           {"question": "The sky is", "choices": ["blue", "green"], "answer": 0},
           {"question": "1 2 3", "choices": ["4", "x 9"], "answer": 0}]
PROMPTS = [{"prompt": "What is 3 + 4?", "answer": "7"},
           {"prompt": "Count: 1 2 3", "answer": "4"}]
MAX_TOKENS = 8


def _tasks(folder: Path) -> Path:
    """Two lm-eval tasks over local JSONL files (no hub)."""
    (folder / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in CHOICES))
    (folder / "gen.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    (folder / "mc.yaml").write_text(f"""task: retrain_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (folder / "gen.yaml").write_text(f"""task: retrain_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {MAX_TOKENS}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")
    return folder


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model):
    """A 2-step tiny run whose prompts are the plain text lm-eval sends (no template, no
    instruction appended)."""
    folder = tmp_path_factory.mktemp("lm-eval-run")
    path = write_config(folder, data={"source": "arithmetic", "eval_size": 8,
                                      "chat_template": False, "instruction": ""},
                        training={"max_steps": 2, "save_every": 2, "max_tokens": MAX_TOKENS},
                        logging={"log_dir": str(folder / "logs")})
    assert run_app(["run", str(path)]) == 0
    return folder / "logs" / "run"


@pytest.fixture(scope="module")
def evaluated(run_dir, tiny_model, model_cache, tmp_path_factory, monkeypatch_module):
    """lm-eval's samples for the base model and the adapter, from one serve process."""
    from lm_eval.tasks import TaskManager

    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    tasks = _tasks(tmp_path_factory.mktemp("lm-eval-tasks"))
    state = tmp_path_factory.mktemp("lm-eval-serve")
    samples = {}
    with serve_process(model_cache, state, "--adapter", f"trained={run_dir}") as server:
        for model in ("tiny-random", "trained"):
            out = lm_eval.simple_evaluate(
                model="local-completions",
                model_args={"model": model, "base_url": f"{server.url}/v1/completions",
                            "tokenizer": tiny_model, "tokenizer_backend": "huggingface",
                            "num_concurrent": 1, "max_retries": 1, "max_length": 512},
                tasks=["retrain_mc", "retrain_gen"],
                task_manager=TaskManager(include_path=str(tasks)), log_samples=True)
            samples[model] = out["samples"]
        yield server, samples


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _encode(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's own split: trailing spaces of the context go with the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    return whole, len(tokenizer(context, add_special_tokens=False)["input_ids"])


def _scored(samples: list[dict]) -> list[tuple[str, str, float]]:
    return [(s["arguments"][i][0], s["arguments"][i][1], s["resps"][i][0][0])
            for s in samples for i in range(len(s["arguments"]))]


def test_loglikelihoods_are_the_tinker_sdks_prompt_logprobs(evaluated, tiny_model, sdk_env):
    from transformers import AutoTokenizer

    server, samples = evaluated
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    scored = _scored(samples["tiny-random"]["retrain_mc"])
    assert len(scored) == sum(len(r["choices"]) for r in CHOICES)
    with tinker.ServiceClient(base_url=server.url) as service:
        sampler = service.create_sampling_client(base_model="tiny-random").result()
        for context, continuation, got in scored:
            whole, ctxlen = _encode(tokenizer, context, continuation)
            res = sampler.sample(types.ModelInput.from_ints(whole), 1,
                                 types.SamplingParams(max_tokens=1, temperature=0.0),
                                 include_prompt_logprobs=True).result()
            assert got == pytest.approx(sum(res.prompt_logprobs[ctxlen:]), abs=1e-5)


def test_the_adapters_loglikelihoods_are_its_own(evaluated, tiny_model, tiny_engine, run_dir,
                                                  tmp_path):
    from transformers import AutoTokenizer

    _, samples = evaluated
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    [adapter] = load_adapters(tiny_engine, CheckpointStore(tmp_path, "tiny-random"),
                              find_runs([AdapterSpec("trained", run_dir, None)])).values()
    base, trained = (_scored(samples[m]["retrain_mc"]) for m in ("tiny-random", "trained"))
    try:
        for context, continuation, got in trained:
            whole, ctxlen = _encode(tokenizer, context, continuation)
            want = tiny_engine.sample(adapter.snap, whole, 1, SamplingParams(max_tokens=1),
                                      True).prompt_logprobs
            assert got == pytest.approx(sum(want[ctxlen:]), abs=1e-5)
    finally:
        tiny_engine.drop_snapshot(adapter.snap)
    assert [s[2] for s in base] != pytest.approx([s[2] for s in trained], abs=1e-6)


def test_generations_are_the_greedy_text_of_tinker_and_retrain_eval(evaluated, run_dir,
                                                                     tmp_path, sdk_env,
                                                                     tiny_model, capsys):
    from transformers import AutoTokenizer

    server, samples = evaluated
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    base = [s["resps"][0][0] for s in samples["tiny-random"]["retrain_gen"]]
    with tinker.ServiceClient(base_url=server.url) as service:
        sampler = service.create_sampling_client(base_model="tiny-random").result()
        for row, got in zip(PROMPTS, base, strict=True):
            ids = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
            res = sampler.sample(types.ModelInput.from_ints(ids), 1, types.SamplingParams(
                max_tokens=MAX_TOKENS, temperature=0.0)).result().sequences[0]
            want = tokenizer.decode(res.tokens, skip_special_tokens=True)
            assert got == want.split("\n")[0]
    data = tmp_path / "gen.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    assert run_app(["eval", str(run_dir), "--data", str(data)]) == 0
    [records] = [p for p in (run_dir / "evals").glob("gen-*.jsonl")]
    completions = [json.loads(line)["completion"] for line in records.read_text().splitlines()]
    trained = [s["resps"][0][0] for s in samples["trained"]["retrain_gen"]]
    assert trained == [c.split("\n")[0] for c in completions]
