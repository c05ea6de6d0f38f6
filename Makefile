# The two commands of the README quickstart: `make demo` and `make test`.
# Each creates .venv on first use and installs torch pinned first: a looser torch requirement
# installed first would pull a multi-GB CUDA build onto a CPU machine.
# On a GPU machine: make TORCH_SPEC="torch==2.13.0" EXTRAS="dev,gpu" test
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
PY := $(VENV)/bin/python
STAMP := $(VENV)/.longstraw-installed

.PHONY: demo state-demo test test-fast test-slow test-distributed lint format memory benchmark pipeline-benchmark paper-tables scale-check clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) recipes/grpo_qwen36.py

state-demo: $(STAMP)
	$(PY) -m longstraw_core.demo

# Every test, the multi-rank (gloo) and fault-injection ones included: what CI runs.
test: $(STAMP)
	$(PY) -m pytest -q --durations=15
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

# The memory planner's tables at paper scale, docs/memory_plans.md, and the pipeline-stage
# tables in docs/pipeline_plans.md (about two minutes).
paper-tables: $(STAMP)
	$(PY) docs/tools/paper_tables.py docs/memory_plans.md
	$(PY) docs/tools/paper_tables.py --pipeline docs/pipeline_plans.md

# One whole GRPO step of each paper configuration at its real dimensions, stage by stage on
# fake tensors (no memory), each stage's tracked peak against the planner's and the 96 GiB
# budget: docs/benchmarks/scale_check.json (hours on 2 cores; not part of `make test`, whose
# tests/test_scale_check.py runs a 4-layer real-width version). STAGES=0,3 reports only those
# (the stages before them run too); RUN=glm52-lora-2.1M one configuration.
scale-check: $(STAMP)
	$(PY) -m longstraw_core.scale_check $(if $(RUN),--run $(RUN)) $(if $(STAGES),--stages $(STAGES))

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
