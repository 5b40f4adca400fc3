# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The library itself accepts a range of torch versions; the install step pins the CPU wheel
# that lies on this machine's disk (an unpinned torch would pull a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0

.PHONY: venv test demo lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[hf,dev]" "$(TORCH_PIN)"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m ruff check src tests
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest

demo: venv
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/attnres demo --out runs/demo --report report.md

lint: venv
	$(PY) -m ruff check src tests
	$(PY) -m ruff format --check src tests

clean:
	rm -rf $(VENV) runs .pytest_cache
