#!/usr/bin/env bash
# make compat TORCH=X: the suite's compatibility tier on torch X, in a venv of its own
# (.venv-compat/torch-X, built once and kept). Only the pinned torch is a CPU wheel on this machine's
# disk; other versions are multi-GB CUDA builds from the package index (they run on the CPU too).
# The tier: tests/test_compat.py, the differential matrix's pairwise table, its bf16 cases and its
# per-tensor optimizer cases at every stage and world size, and the quick tier of the engine suites
# (docs/engine.md, "Supported torch versions").
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: tools/compat.sh TORCH_VERSION (e.g. 2.11.0)}"
version="${version#torch==}"
py="${PY:-python3}"
venv=".venv-compat/torch-$version"
if [ ! -f "$venv/.installed" ]; then
  echo "compat: building $venv (torch==$version; a CUDA build is several GB)"
  "$py" -m venv "$venv"
  # a machine-wide pip constraint may cap torch below the newest release: lifted for this venv only
  PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q "torch==$version"
  PIP_CONSTRAINT=/dev/null "$venv/bin/pip" install -q -e '.[dev,train]'
  touch "$venv/.installed"
fi
"$venv/bin/python" -c "import torch; print('compat: torch', torch.__version__)"
start=$(date +%s)
ZERODP_ALL_WORLDS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_compat.py \
  "tests/test_engine_matrix.py::test_matrix_pairwise" \
  "tests/test_engine_matrix.py::test_matrix_bf16_at_every_stage_and_world" \
  "tests/test_engine_matrix.py::test_matrix_per_tensor_optimizers_at_every_stage_and_world"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not fuzz and not browser" \
  tests/test_engine_stage0.py tests/test_engine_zero.py tests/test_engine_stage3.py tests/test_engine_idioms.py \
  tests/test_state_dict.py tests/test_engine_compile.py tests/test_train_cli.py
echo "compat: torch $version passed the tier in $(( $(date +%s) - start )) s"
