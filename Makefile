# The documented entry points. `make demo` and `make test` set everything up first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test unit lint fmt bench bootstrap venv up down status clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

bootstrap:
	bash scripts/bootstrap.sh

up: bootstrap venv
	$(BIN)/dsec up

down: venv
	$(BIN)/dsec down

status: venv
	$(BIN)/dsec status

demo: up
	$(BIN)/dsec demo

test: up
	$(BIN)/pytest -q

unit: venv
	$(BIN)/pytest -q -m "not integration"

lint: venv
	$(BIN)/ruff check app workers tests bench migrations scripts
	$(BIN)/ruff format --check app workers tests bench scripts
	$(BIN)/mypy
	$(BIN)/lint-imports

fmt: venv
	$(BIN)/ruff format app workers tests bench
	$(BIN)/ruff check --fix app workers tests bench

bench: up
	$(BIN)/python bench/exec.py
