#!/usr/bin/env bash
# Run a command as on the slow machine of its kind (issue 54): PyTorch and oneDNN on AVX2 kernels, and a CPU quota
# that brings the pace down to that machine's. Needs a writable cgroup v1 `cpu` hierarchy or cgroup v2 (root in a
# sandbox); else say so and stop, since `taskset` only pins cores and does not slow them.
#
#   bench/emulate_slow.sh [--cores Q] -- COMMAND...     # Q: cores' worth of CPU time (default 2, no quota)
#
# Check the emulation against the slow machine's own figures before quoting it (docs/results.md says which):
# 0.28 requests/s for `python -m bench.inference --model models/smollm2-135m --requests 40` with
# params.real-model.yaml and params.vllm-cpu.yaml in float32, and about 8 requests/s of demo traffic.
set -euo pipefail
cores=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cores) cores="$2"; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--cores Q] -- COMMAND..." >&2; exit 2; }
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
if [ -n "$cores" ]; then
  period=100000
  quota=$(python3 -c "print(int(float('$cores') * $period))")
  if [ -d /sys/fs/cgroup/cpu ] && [ -w /sys/fs/cgroup/cpu ]; then  # cgroup v1
    group=/sys/fs/cgroup/cpu/tabrl-slow-$$
    mkdir -p "$group"
    echo "$period" > "$group/cpu.cfs_period_us"
    echo "$quota" > "$group/cpu.cfs_quota_us"
    echo 102400 > "$group/cpu.shares"  # its quota, not other work on the machine, is what bounds it
  elif [ -w /sys/fs/cgroup/cgroup.subtree_control ]; then  # cgroup v2
    group=/sys/fs/cgroup/tabrl-slow-$$
    mkdir -p "$group"
    echo "$quota $period" > "$group/cpu.max"
    echo 10000 > "$group/cpu.weight"  # its quota, not other work on the machine, is what bounds it
  else
    echo "error: no writable cgroup here for a CPU quota of $cores cores; run without --cores (AVX2 kernels only)" >&2
    exit 1
  fi
  echo $$ > "$group/cgroup.procs"
  trap 'echo $$ > "$(dirname "$group")/cgroup.procs"; rmdir "$group" 2>/dev/null || true' EXIT
  echo ">> emulating the slow machine: AVX2 kernels, a CPU quota of $cores cores ($group)" >&2
else
  echo ">> emulating the slow machine: AVX2 kernels, no CPU quota" >&2
fi
"$@"
