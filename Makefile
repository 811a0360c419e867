# zerodp: `make demo` and `make test` each do all set-up on a fresh machine, then run.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# torch first and pinned: pip then takes the CPU wheel on disk instead of a CUDA build. The
# planner alone needs no torch (pip install .); training, tests and the demo use the train extra,
# the fault-tolerant replica groups (tests/test_ft_*.py) the ft extra (torchft).
TORCH   ?= torch==2.13.0

.PHONY: setup demo test test-fast fuzz chaos browser clean gpu-check compat

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev,train,ft]'
	touch $(STAMP)

# Debian's Chromium for the browser tests (never a browser that a tool downloads itself).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium missing: run 'sudo apt-get install chromium' (the browser tests need it)"; fi; }

demo: setup
	$(BIN)/zerodp train

# Two pytest workers, whole files each (--dist loadfile keeps a file's spawned groups and module
# fixtures together): many checks wait on timeouts, rendezvous and browsers rather than the CPU.
test: setup browser
	$(BIN)/ruff check src tests
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

test-fast: setup
	$(BIN)/python -m pytest -q -m "not dist and not browser"

# Property-based tests with many more generated cases than make test runs (profile "fuzz"),
# 520 random combinations of the engine's differential matrix (and 52 of its DiLoCo cases), and
# 5,000 generated call sequences of the engine vs single-process torch (tests/test_engine_fuzz.py;
# and 500 of DiLoCo vs its update rule at 2-4 ranks, make test: one per stage at 3); the three
# torch.compile forms at every stage on 2 and 3 ranks (make test: stages 0 and 3, 2 ranks), the
# per-tensor optimizers on 1 to 4 ranks (make test: 2), and the stage 0, ZeRO-1/2, stage 3
# and correctness suites at world sizes 2-4 (make test: 2 — the matrix covers 1-4 there) and the
# planner's ownership check on 2, 3 and 4 ranks (make test: 3); the 4-rank compressed/hybrid bench run,
# the matrix's hand-picked hybrid, compressed and per-tensor optimizer (× every stage × world 1-4)
# cases and its codec check (make test: the pairwise table), and the 4-to-2-rank reshard of a
# training run with its export and its bitwise resume at every stage (make test: 0, 1, 3), and
# zerodp check on its three acceptance models, exact and perturbed (make test: a small model); and
# the long end-to-end runs (tests marked in_make_fuzz, each naming what make test keeps): the
# short chaos run, SIGTERM preemption with its bitwise resume, the two-launcher hybrid run, the
# quick bench, train --bucket-mb auto, a corpus smaller than one global batch at world 3, the replica
# groups' heal at stages 0 and 3 (plain and under DiLoCo) and zerodp train --replica-groups with a killed group; the
# four ported scripts at worlds 2 and 3 with twice the steps (make test: world 2); and the compat tier
# on the oldest (2.9.1) and newest (2.15.0) torch (make compat).
fuzz: setup
	$(MAKE) compat TORCH=2.9.1
	$(MAKE) compat TORCH=2.15.0
	ZERODP_MATRIX_RANDOM=520 ZERODP_ENGINE_FUZZ=5000 $(BIN)/python -m pytest -q -s -m fuzz --hypothesis-profile=fuzz
	ZERODP_COMPILE_ALL=1 ZERODP_OPTIMIZER_WORLDS=2,1,3,4 ZERODP_ALL_WORLDS=1 $(BIN)/python -m pytest -q -n 2 \
	  --dist loadfile tests/test_engine_compile.py tests/test_engine_optimizers.py tests/test_engine_stage3.py \
	  tests/test_engine_zero.py tests/test_engine_stage0.py tests/test_engine_correctness.py tests/test_plan_ownership.py \
	  tests/test_bench_compressed.py tests/test_engine_matrix.py tests/test_train_resume.py tests/test_check_models.py \
	  tests/test_chaos_short.py tests/test_preempt.py tests/test_multinode.py tests/test_bench_compare.py \
	  tests/test_auto_bucket.py tests/test_reliability_data.py tests/test_porting_scripts.py \
	  tests/test_ft_heal.py tests/test_ft_train.py

# The compatibility tier on another torch (docs/engine.md, "Supported torch versions"): a venv of
# its own per version under .venv-compat (built once: a CUDA build of several GB from the index),
# then tests/test_compat.py, the matrix's pairwise table with its bf16 and per-tensor optimizer
# cases, and the quick tier of the engine suites. make compat TORCH=2.11.0
compat:
	PY=$(PY) tools/compat.sh $(TORCH)

# The chaos run: a seeded schedule of 7 faults over a 200-step run under --max-restarts, a report
# of each, and the final state compared bitwise with an uninterrupted run (SEED=N draws another).
# Then replica groups that survive (zerodp.ft, torchft): 2 groups of 2 ranks, a whole group or one
# rank SIGKILLed every 60 s for 10 minutes, each group healed from its peer, the checks (a healed
# group's state equal to its peer's, bitwise); and the goodput schedule (zerodp.ft.goodput): zerodp
# train fault-free, with heal from a peer and with restart from a checkpoint under the same kills,
# committed tokens per second side by side (about 50 minutes in all).
chaos: setup
	$(BIN)/python -m zerodp.train.chaos --seed $(or $(SEED),0) --steps 200
	$(BIN)/python -m zerodp.ft.chaos --seed $(or $(SEED),0) --duration-s 600 --every-s 60 --no-reference
	$(BIN)/python -m zerodp.ft.goodput --seed $(or $(SEED),0) --duration-s 600 --every-s 60

# The GPU path on this machine's CUDA GPUs (one rank per GPU, NCCL, world N; about five minutes):
# the differential matrix, the CUDA-event trace, the memory ledger per stage (the allocator against
# the engine and the planner), zerodp bench vs DDP/FSDP2, each a check with a stated bound; prints
# torch/CUDA/NCCL, writes docs/gpu.md, exits 1 if a phase failed. Without a GPU it prints one line
# and runs nothing. The same phases on CPU (gloo, small; make test runs them, tests/test_gpu_path.py):
# python -m zerodp.bench.gpu_check --device cpu [--world N] (report: out/gpu-check-cpu.md)
gpu-check: setup
	$(BIN)/python -m zerodp.bench.gpu_check

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
