#!/usr/bin/env bash
# The one-GPU check of issue 24: the `gpu` test tier plus a bf16 Llama 3.2 1B throughput run on one
# GPU, JSON in bench/results/gpu_check.json (bench/gpu_check.py says what it measures). ~6 minutes on
# an H100/H200.
#
#   bash bench/gpu_check.sh          on a machine with CUDA (torch with CUDA already installed)
#   bash bench/gpu_check.sh --cpu    the dry run on a CPU-only machine (llama-tiny, same steps)
#
# A GPU machine often has torch with CUDA but not pipetrain's other dependencies, and no network.
# Bring them as wheels, downloaded on a machine that has pip and a network, for the GPU machine's
# Python (python3 --version there; 3.12 below), into .whl/ of this checkout:
#
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl hydra-core==1.3.2 omegaconf==2.3.0 tensorboardX==2.6.2.2
#   pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3     # hydra's parser: an sdist, built here
#
# (rich, numpy, pyyaml, safetensors, tokenizers, pytest and pytest-xdist are in most CUDA images; add
# them the same way if not.) This script installs .whl/*.whl (or $PIPETRAIN_WHEELS/*.whl) without the
# network when hydra is missing, then pipetrain itself in editable mode, also offline.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 WANDB_MODE=offline

if ! "$PY" -c "import hydra, omegaconf" 2>/dev/null; then
    wheels=${PIPETRAIN_WHEELS:-.whl}
    ls "$wheels"/*.whl >/dev/null 2>&1 || { echo "hydra-core is missing and $wheels/ holds no wheels: see the top of $0" >&2; exit 2; }
    "$PY" -m pip install -q --no-index --no-deps --no-compile "$wheels"/*.whl
fi
if ! "$PY" -c "import importlib.resources as r; r.files('pipetrain.conf')" 2>/dev/null; then
    # editable: conf/ and recipes/ ship as pipetrain.conf / pipetrain.recipes (pyproject.toml)
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
fi
exec "$PY" bench/gpu_check.py "$@"
