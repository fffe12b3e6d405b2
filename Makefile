# Two entry points a new user needs: `make demo` and `make test`.
# Both build their own virtualenv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Test workers: most tests wait on sockets and subprocesses, so more workers
# than cores keep the CPUs busy. Tests that share a module's setup (packaging
# builds, NeMo Gym stacks) stay on one worker (SERIAL_GROUPS, tests/conftest.py).
TEST_WORKERS ?= 4

.PHONY: demo test lint bench bench-smoke clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

test: $(STAMP)
	$(BIN)/ruff check dispatcher tests bench scripts
	$(BIN)/mypy dispatcher
	# Compiled once: hundreds of `python -m dispatcher` subprocesses would each recompile it.
	$(BIN)/python -m compileall -q dispatcher
	# The NeMo Gym venv, built here when a Python 3.13 is found (tests/gym/gym_env.py).
	@$(BIN)/python tests/gym/gym_env.py --prepare
	# -rs: every skipped test says why at the end.
	$(BIN)/pytest -q -rs -n $(TEST_WORKERS)

lint: $(STAMP)
	$(BIN)/ruff check dispatcher tests bench scripts
	$(BIN)/mypy dispatcher

bench: $(STAMP)
	$(BIN)/python bench/dispatch_overhead.py --telemetry-off --memory
	$(BIN)/python bench/loop_lag.py
	$(BIN)/python bench/resume_startup.py
	$(BIN)/python bench/capture_overhead.py
	$(BIN)/python bench/retries.py
	$(BIN)/python bench/adaptive.py
	$(BIN)/python bench/hostile_answers.py
	$(BIN)/python bench/big_rows.py --offload-compare
	$(BIN)/python bench/service.py
	$(BIN)/python bench/settled_jobs.py
	$(BIN)/python bench/many_jobs.py
	$(BIN)/python bench/latency_window.py
	$(BIN)/python bench/step_control.py
	$(BIN)/python bench/ordering.py
	$(BIN)/python bench/cli_startup.py
	$(BIN)/python bench/routing.py
	$(BIN)/python bench/report_timeline.py

bench-smoke: $(STAMP)
	$(BIN)/python bench/dispatch_overhead.py --smoke
	$(BIN)/python bench/loop_lag.py --smoke
	$(BIN)/python bench/resume_startup.py --smoke
	$(BIN)/python bench/capture_overhead.py --calls 300 --stream-calls 100 --rows 200
	$(BIN)/python bench/retries.py --smoke
	$(BIN)/python bench/adaptive.py --smoke
	$(BIN)/python bench/big_rows.py --smoke --repeat 1
	$(BIN)/python bench/service.py --smoke
	$(BIN)/python bench/settled_jobs.py --smoke
	$(BIN)/python bench/many_jobs.py --smoke
	$(BIN)/python bench/burst_submits.py --smoke
	$(BIN)/python bench/latency_window.py --smoke
	$(BIN)/python bench/step_control.py --smoke
	$(BIN)/python bench/answer_paths.py --smoke
	$(BIN)/python bench/ordering.py --smoke
	$(BIN)/python bench/report_timeline.py --smoke
	$(BIN)/python bench/service_hostile.py --smoke
	$(BIN)/python bench/cli_startup.py --smoke
	$(BIN)/python bench/routing.py --smoke

clean:
	rm -rf $(VENV) demo-output
