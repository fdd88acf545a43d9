"""`[backend] compile`: the compiled decoding step samples what the eager one does, and a
compile that fails costs one line and falls back to eager."""

from __future__ import annotations

import io
import os

import pytest

from retrain.backends.local.sampling import compiled
from retrain.config.sections import ConfigError, from_dict


def test_compile_takes_true_false_or_auto():
    assert from_dict({}).backend.compile == "auto"
    for value in (True, False, "auto"):
        assert from_dict({"backend": {"compile": value}}).backend.compile == value
    for bad in ("yes", 1):
        with pytest.raises(ConfigError, match='backend.compile.*expected true or false or "auto"'):
            from_dict({"backend": {"compile": bad}})
    assert compiled.wanted(True)
    assert not compiled.wanted(False) and not compiled.wanted("auto")


torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from retrain.backends.base import SamplingParams  # noqa: E402
from retrain.backends.local.backend import LocalBackend  # noqa: E402

PROMPTS = [[1, 5, 9, 13], [1, 7], [1, 3, 3, 3, 3, 3, 8]]


@pytest.fixture
def backend(model):
    b = LocalBackend.new_adapter(model, "compiled", lora_rank=4, seed=3)
    yield b
    b.close()
    model.delete_adapter("compiled")
    model.decoder = None


def _sample(backend, temperature: float):
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=9)
    return [c for g in backend.sample(PROMPTS, 4, params) for c in g]


def _same(eager, other, tol: float) -> None:
    for a, b in zip(eager, other, strict=True):
        assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < tol


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_compiled_step_samples_what_eager_does(model, backend, temperature):
    eager = _sample(backend, temperature)
    model.compile_decoding()  # what a run does; under AVX2 kernels through peft's wrapper: NaN
    model.decoder.say = io.StringIO()
    compiled = _sample(backend, temperature)
    assert model.decoder.failed is None, model.decoder.failed
    _same(eager, compiled, 1e-4)


def test_the_inductor_cache_has_a_folder_per_instruction_set(model, monkeypatch, model_cache):
    """Kernels cached under AVX-512 gave NaN when loaded under AVX2 (see sampling.compiled)."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    compiled.CompiledDecoder(model.net, compile_fn=lambda net, dynamic: net)
    isa = torch.backends.cpu.get_cpu_capability().lower()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(model_cache / "inductor" / isa)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # the user's choice stands
    compiled.CompiledDecoder(model.net, compile_fn=lambda net, dynamic: net)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/elsewhere"


def _not_finite(net, dynamic):
    """A 'compiled' step that runs the real one (its KV cache written) but returns NaN."""
    def step(**kwargs):
        out = net(**kwargs)
        out.logits = torch.full_like(out.logits, float("nan"))
        return out
    return step


def test_a_compiled_step_with_nan_logits_is_taken_back_and_run_eagerly(model, backend):
    eager = _sample(backend, 1.0)
    said = io.StringIO()
    model.decoder = compiled.CompiledDecoder(model.base, say=said, compile_fn=_not_finite)
    again = _sample(backend, 1.0)
    assert said.getvalue() == ("compile: torch.compile of the decoding step failed (its logits "
                               "were not finite); decoding eagerly\n")
    _same(eager, again, 1e-6)  # the NaN step's KV positions were taken back


def _refuse(_graph, _inputs):
    raise RuntimeError("no C++ compiler here")


def test_a_failed_compile_says_so_once_and_decodes_eagerly(model, backend):
    eager = _sample(backend, 1.0)
    said = io.StringIO()
    model.decoder = compiled.CompiledDecoder(
        model.net, say=said,
        compile_fn=lambda net, dynamic: torch.compile(net, dynamic=dynamic, backend=_refuse))
    fallen = _sample(backend, 1.0)
    again = _sample(backend, 1.0)
    lines = said.getvalue().splitlines()
    assert len(lines) == 1 and "no C++ compiler here" in lines[0]
    assert lines[0].startswith("compile: torch.compile of the decoding step failed (")
    assert lines[0].endswith("; decoding eagerly")
    _same(eager, fallen, 1e-6)
    _same(eager, again, 1e-6)


def test_out_of_memory_is_not_taken_for_a_failed_compile(model, backend):
    def no_memory(**_kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    said = io.StringIO()
    model.decoder = compiled.CompiledDecoder(model.net, say=said,
                                                  compile_fn=lambda net, dynamic: no_memory)
    with pytest.raises(Exception, match="out of memory"):
        _sample(backend, 1.0)
    assert said.getvalue() == "" and model.decoder.failed is None
