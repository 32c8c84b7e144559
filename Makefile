# The two commands of the README.
.PHONY: qualify test lint bootstrap

bootstrap:
	@bash scripts/bootstrap

# Runs the main job on the embedded defaults: local engine, SQLite store, CPU where no GPU is present.
qualify: bootstrap
	.venv/bin/qualify run --layout 2304,2304,2304,9216

# Runs lint and the whole CPU test suite (PostgreSQL and Docker tests start their own services), then the
# `serial` tests. The first step runs in PYTEST_WORKERS pytest-xdist workers (each with its own QUALIFY_HOME
# and PostgreSQL cluster; the Docker tests one at a time across them, tests/conftest.py) that steal work
# from each other (`--dist worksteal`), so the long `qualify run` tests do not pile up at one worker's end.
# On the 2-core machine (2026-12-04, one checkout, back to back) the first step took 1305 s in one process,
# 1151 s in two workers with xdist's default `load` split, and 899 s with `worksteal` (a CPU `qualify run`
# keeps about one core busy: 12 core-seconds in 13 s, the rest is waiting). On 2026-12-06 (a fresh clone,
# more tests) it took 1026 s, and 799 s once the second engine and the workers' own torch computed with one
# intra-op thread, as the reference engine does. PYTEST_WORKERS=0: one process.
# Exit 5 (nothing selected, e.g. by a -k in PYTEST_ARGS) is not a failure of either step.
PYTEST_WORKERS ?= 2
test: bootstrap
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -m "not gpu and not serial" -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS) \
		|| [ $$? -eq 5 ]
	.venv/bin/python -m pytest -m "not gpu and serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]

lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
