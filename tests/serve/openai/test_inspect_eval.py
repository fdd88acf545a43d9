"""inspect-ai, through its OpenAI-compatible provider (`openai-api/<service>/<model>`),
evaluates a trained run served by a real `retrain serve --adapter` process: a two-sample
local task with a match scorer, offline. Skipped where the `eval` extra is absent."""

from __future__ import annotations

from importlib.util import find_spec

import pytest

from retrain.cli.app import run_app
from tests.run_helpers import serve_process, write_config

# Imported in the test: collecting the suite would import inspect-ai (~3 s) in every worker.
pytestmark = pytest.mark.skipif(find_spec("inspect_ai") is None or find_spec("openai") is None,
                                reason="inspect-ai is not installed (pip install 'retrain[eval]')")

KEY = "sk-inspect-5d20"
QUESTIONS = {"What is 2 + 2?": "4", "What is 3 + 4?": "7"}


def test_inspect_ai_evaluates_a_run_served_by_retrain_serve(tmp_path, tiny_model, model_cache,
                                                            monkeypatch):
    path = write_config(tmp_path, training={"max_steps": 1, "save_every": 1},
                        logging={"log_dir": str(tmp_path / "logs")})
    import inspect_ai
    import openai
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import match
    from inspect_ai.solver import generate

    assert run_app(["run", str(path)]) == 0
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))  # inspect's traces, not ~
    task = inspect_ai.Task(name="arithmetic", scorer=match(), solver=generate(),
                           dataset=[Sample(input=q, target=a) for q, a in QUESTIONS.items()])
    with serve_process(model_cache, tmp_path / "state", "--api-key", KEY,
                       "--adapter", f"trained={tmp_path / 'logs' / 'run'}") as served:
        [log] = inspect_ai.eval(task, model="openai-api/retrain/trained",
                                model_base_url=f"{served.url}/v1", model_args={"api_key": KEY},
                                log_dir=str(tmp_path / "inspect"), display="none",
                                max_tokens=8, temperature=0.0, max_retries=1, timeout=120)
        # the same questions asked directly: inspect's answers are the served run's own
        with openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0) as client:
            direct = {q: client.chat.completions.create(
                model="trained", messages=[{"role": "user", "content": q}], max_tokens=8,
                temperature=0.0).choices[0].message.content for q in QUESTIONS}
        assert "Traceback" not in served.log()
    assert log.status == "success", log.error
    assert log.eval.model == "openai-api/retrain/trained"
    [score] = log.results.scores
    assert score.scorer == "match" and score.scored_samples == 2 and score.unscored_samples == 0
    assert 0.0 <= score.metrics["accuracy"].value <= 1.0
    assert len(log.samples) == 2
    for sample in log.samples:
        assert sample.scores["match"].value in ("C", "I")
        assert sample.output.completion == direct[sample.input]
