#!/usr/bin/env bash
# The wheels bench/gpu/run.sh installs on a lent GPU machine (Python 3.12, manylinux x86_64, no network), into
# bench/gpu/wheels/ (git-ignored; it travels with the working tree, ~7 MB of the 64 MiB a call may carry):
#
#   bash bench/gpu/wheels.sh           # needs the registry and the project venv (.venv, or PYTHON=...)
#
# DeepSpeed publishes only a source archive: it is built here into a pure-Python wheel with no prebuilt ops
# (DS_BUILD_OPS=0; the GPU JIT-builds any op it needs). The rest are binary wheels of the versions the
# project venv runs, with their own dependencies; the GPU image's torch, numpy, transformers stay as they are.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-.venv/bin/python}"
WHEELS=bench/gpu/wheels
mkdir -p "$WHEELS"

echo ">> DeepSpeed 0.19.8: a wheel from its source archive"
DS_BUILD_OPS=0 "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WHEELS" deepspeed==0.19.8

echo ">> DeepSpeed's dependencies, pydantic and PyYAML (tasks/core/config.py): cp312 manylinux x86_64 wheels"
"$PYTHON" -m pip download --quiet --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$WHEELS" \
  hjson==3.1.0 py-cpuinfo==9.0.0 msgpack==1.2.4 ninja==1.13.2 einops==0.8.2 psutil==7.2.2 packaging==26.4 \
  tqdm==4.70.1 pydantic==2.14.4 pyyaml==6.0.4

du -sh "$WHEELS"
ls "$WHEELS"
