# The documented entry points. `make demo` and `make test` set everything up first.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test unit lint fmt bench bootstrap venv up down status clean dist lock

# The SDK's distribution first: the server's depends on that very version of it. Both
# editable, so the checkout's files are what runs (sdk/app only links to them). Every
# other package at the version constraints.txt holds: what the suite passed with.
$(STAMP): pyproject.toml sdk/pyproject.toml setup.py constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e ./sdk
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
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
	$(BIN)/ruff check app workers tests bench migrations scripts setup.py
	$(BIN)/ruff format --check app workers tests bench scripts setup.py
	$(BIN)/mypy
	$(BIN)/lint-imports

fmt: venv
	$(BIN)/ruff format app workers tests bench
	$(BIN)/ruff check --fix app workers tests bench

# Both distributions, sdist and wheel each, in dist/: the server (dsec) and the
# trainer's SDK (dsec-sdk). docs/deploy.md installs them.
dist: venv
	rm -rf dist
	$(BIN)/python -m build sdk --outdir dist
	$(BIN)/python -m build . --outdir dist

bench: up
	$(BIN)/python bench/exec.py

# Records the venv's third-party versions as the constraints fresh installs use: run
# after `make test` passed on them (for example after `pip install -U` of a package).
lock: venv
	{ sed -n '/^#/p' constraints.txt; $(BIN)/pip freeze --exclude-editable | grep -v '^#'; } \
		> constraints.txt.new && mv constraints.txt.new constraints.txt
