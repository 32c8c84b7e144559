# The two commands of the README.
.PHONY: qualify test lint bootstrap

bootstrap:
	@bash scripts/bootstrap

# Runs the main job on the embedded defaults: local engine, SQLite store, CPU where no GPU is present.
qualify: bootstrap
	.venv/bin/qualify run --layout 2304,2304,2304,9216

# Runs lint and the whole CPU test suite (PostgreSQL and Docker tests start their own services), then the
# `serial` tests. PYTEST_WORKERS > 0 runs the first step in that many pytest-xdist workers (each with its
# own QUALIFY_HOME and PostgreSQL cluster; the Docker tests one at a time across them, tests/conftest.py).
# The default is none: on the 2-core CI machine two workers took the whole CI run from 1253 s to 1444 s
# (the suite is mostly engines booting and running, which already keep both cores busy). Exit 5 (nothing
# selected, e.g. by a -k in PYTEST_ARGS) is not a failure of either step.
PYTEST_WORKERS ?= 0
test: bootstrap
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -m "not gpu and not serial" -n $(PYTEST_WORKERS) $(PYTEST_ARGS) \
		|| [ $$? -eq 5 ]
	.venv/bin/python -m pytest -m "not gpu and serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]

lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
