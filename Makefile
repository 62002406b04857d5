# The two commands of the README: `make run` and `make test`.
PY := .venv/bin/python

# `make run` needs the package alone (EXTRAS=none): nothing a test or a peer needs.
.PHONY: setup setup-run setup-peers run test test-slow test-compat lint bench clean

setup:
	bash scripts/setup.sh

# For the tests .venv also carries the peers (verl 0.9.1 with its transformers pin, TRL 1.16.0,
# Opacus), so the peer tests run in `make test`; VARBENCH_REQUIRE_PEERS=1 makes a missing peer
# fail, not skip.
setup-run:
	EXTRAS=none bash scripts/setup.sh

setup-peers:
	EXTRAS=dev,peers bash scripts/setup.sh

# The lowest and the newest transformers the pyproject admits, each in its own venv, on the
# tests that touch transformers' APIs (models, rollout and its KV cache, precision, training).
COMPAT_TESTS := tests/test_models_forward.py tests/test_models_io.py tests/test_models_presets.py \
	tests/test_models_tokenizer.py tests/test_rollout_kvcache.py tests/test_rollout_sampler.py \
	tests/test_grads_precision.py tests/test_grads_exact.py tests/test_train_loop.py
test-compat:
	VENV=.venv-low PIN="transformers==5.0.0" bash scripts/setup.sh
	.venv-low/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	.venv-low/bin/python -m pytest -m "not slow" -q $(COMPAT_TESTS)
	VENV=.venv-new PIN="transformers>=5.0,<6" bash scripts/setup.sh
	.venv-new/bin/python -m pip --quiet install --upgrade "transformers>=5.0,<6"
	.venv-new/bin/python -c "import transformers; print('transformers', transformers.__version__)"
	.venv-new/bin/python -m pytest -m "not slow" -q $(COMPAT_TESTS)

run: setup-run
	.venv/bin/varbench run suites/quickstart.toml --out reports/quickstart

test: setup-peers
	$(PY) -m ruff check varbench tests benchmarks
	.venv/bin/lint-imports
	VARBENCH_REQUIRE_PEERS=1 $(PY) -m pytest -m "not slow" -q

test-slow: setup-peers
	$(PY) -m pytest -m slow -q

lint: setup
	$(PY) -m ruff check varbench tests benchmarks
	.venv/bin/lint-imports

clean:
	rm -rf .venv .venv-low .venv-new .pytest_cache reports/quickstart
