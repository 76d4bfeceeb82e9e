#!/usr/bin/env bash
# The GPU bench of the PPO update in one command (bench/gpu/ppo_bench.py says what it runs):
#
#   bash bench/gpu/run.sh              # a lent H100/H200 (Python 3.12, torch, transformers, peft): ~3 min
#   bash bench/gpu/run.sh --dry-run    # CPU, tiny shapes, every step: what CI runs
#
# Installs what the machine lacks (DeepSpeed and its dependencies, pydantic, PyYAML) from the wheels that
# `bash bench/gpu/wheels.sh` put in bench/gpu/wheels/ (no network there), then runs the bench. Writes
# $OUT/ppo_bench.json (OUT unset: bench/out/gpu). PYTHON picks the interpreter (default: python3), WHEELS the
# wheel folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-bench/gpu/wheels}"
OUT="${OUT:-bench/out/gpu}"

# distribution requirement -> the module that shows it is installed
declare -A NEEDS=([deepspeed==0.19.8]=deepspeed ['pydantic>=2.10']=pydantic [pyyaml]=yaml)
missing=()
for req in "${!NEEDS[@]}"; do
  "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${NEEDS[$req]}') is None)" \
    || missing+=("$req")
done
if [ ${#missing[@]} -gt 0 ]; then
  if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    echo "error: $PYTHON lacks ${missing[*]} and $WHEELS/ holds no wheels: run 'bash bench/gpu/wheels.sh' on a" \
      "machine with the registry, then carry $WHEELS" >&2
    exit 1
  fi
  if ! "$PYTHON" -m pip --version >/dev/null 2>&1; then
    echo "error: $PYTHON lacks ${missing[*]} and has no pip to install them from $WHEELS" >&2
    exit 1
  fi
  echo ">> installing ${missing[*]} (and what they need) from $WHEELS"
  # PEP 668: a lent machine's system Python may be marked externally managed; it is thrown away after the loan
  PIP_BREAK_SYSTEM_PACKAGES=1 "$PYTHON" -m pip install --quiet --no-index --find-links "$WHEELS" "${missing[@]}"
fi
# ninja (DeepSpeed's JIT builds) lands in the interpreter's scripts folder
PATH="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
export PATH

if [[ " $* " != *" --dry-run "* ]] && command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  # the H100 image's default 9.0a crashes DeepSpeed's op builder (shared/STACK-NOTES.md)
  export TORCH_CUDA_ARCH_LIST=9.0
fi
exec "$PYTHON" -m bench.gpu.ppo_bench --out "$OUT" "$@"
