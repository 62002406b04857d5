# The two commands of the README: `make run` and `make test`.
PY := .venv/bin/python

.PHONY: setup run test test-slow lint bench clean

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/varbench run suites/quickstart.toml --out reports/quickstart

test: setup
	$(PY) -m ruff check varbench tests benchmarks
	.venv/bin/lint-imports
	$(PY) -m pytest -m "not slow" -q

test-slow: setup
	$(PY) -m pytest -m slow -q

lint: setup
	$(PY) -m ruff check varbench tests benchmarks
	.venv/bin/lint-imports

clean:
	rm -rf .venv .pytest_cache reports/quickstart
