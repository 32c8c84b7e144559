# The two commands of the README.
.PHONY: qualify test lint bootstrap

bootstrap:
	@bash scripts/bootstrap

# Runs the main job on the embedded defaults: local engine, SQLite store, CPU where no GPU is present.
qualify: bootstrap
	.venv/bin/qualify run --layout 2304,2304,2304,9216

# Runs lint and the whole CPU test suite (PostgreSQL and Docker tests start their own services).
test: bootstrap
	.venv/bin/ruff check .
	.venv/bin/python -m pytest -m "not gpu" $(PYTEST_ARGS)

lint: bootstrap
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
