# The README's two commands (`make bench`, `make test`) and the developer loop.
# Everything goes into a virtual environment, .venv, that sees the system's packages, so an
# already-installed torch (a CUDA build) is used as it is; tools/ensure_torch.py installs a CPU
# build only where no torch is importable.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test test-fast bench bench-quick lint clean

$(BIN)/python:
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml setup.py csrc/ring.h csrc/ring.pxd csrc/_ring.pyx csrc/arena.h csrc/copy.h
	$(BIN)/python tools/ensure_torch.py
	$(BIN)/python -m pip install -q -e ".[test,bench]"
	touch $@

install: $(VENV)/.installed

test: install
	$(BIN)/python -m pytest -q -ra

test-fast: install
	$(BIN)/python -m pytest -q -ra -m "not slow"

bench: install
	$(BIN)/python -m bench

bench-quick: install
	$(BIN)/python -m bench --quick

lint: install
	$(BIN)/python -m pip install -q ruff
	$(BIN)/ruff check shmloader tests bench tools

clean:
	rm -rf build *.egg-info shmloader/*.so csrc/*.c $(VENV)
