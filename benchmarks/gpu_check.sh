#!/usr/bin/env bash
# The nccl path on a GPU machine: the prepared check to run on a lent device, within 10 minutes.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]          (GPU_CHECK_PARTS="gpu sandbox" runs only those parts)
#   GPU_CHECK_DRY_RUN=1 bash benchmarks/gpu_check.sh  (no GPU needed: prints each part's command, runs none;
#                                                    tests/test_gpu_check.py runs it)
#
# Parts, one after another (never side by side: each has the GPUs to itself), each bounded in time and all of them
# within GPU_CHECK_BUDGET seconds (default 560), most telling first:
#   gpu       tests/test_gpu.py without the lessons: nccl chosen with a GPU per rank (gloo beyond), checks.collectives()
#             reading nccl's recorder through the check API, a deadlock found from nccl's states, the timeline marked
#             'queued', NCCL refusing two ranks on one GPU, DDP and SyncBatchNorm against a CPU reference
#   sandbox   the sandbox's uid opens /dev/nvidia* and runs a CUDA tensor under the memory limit grading gives it
#             (benchmarks/gpu_check.py sandbox: the cgroup's own peak against its limit)
#   verifier  one graded check per exercise through the grading pipeline (sandboxed kernel, trusted verifier), every
#             check's policy set to 'auto': nccl with 2 GPUs or more, gloo for multi-rank jobs with 1 GPU
#             (benchmarks/gpu_check.py verifier: the verdict and the grade report's "ran on")
#   lessons   every lesson run top to bottom with the GPUs visible, each job's backend against the GPU count, then
#             each lesson rank function that returned run again at world size = GPU count with its real arguments
#   policy    (not in the default list) the same ex1 check graded as grading runs it: gloo, GPUs hidden
# Logs and JSON reports go to OUTDIR (default $OUT or /tmp/ddp-course-gpu); summary.txt ends with one line per part.
# Python packages the machine lacks can come as wheels in .whl/.
set -u
out=${1:-${OUT:-/tmp/ddp-course-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
started=$(date +%s)
budget=${GPU_CHECK_BUDGET:-560}
dry=${GPU_CHECK_DRY_RUN:-}
stamp() { echo "[gpu-check $(($(date +%s) - started))s] $*"; }
here=$(cd "$(dirname "$0")/.." && pwd)

if [ -z "$dry" ]; then
    {
        stamp "machine"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        # a child process may use CUDA: this script forks no ranks itself
        python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
        echo "cpus $(nproc); cgroup fs $(stat -fc %T /sys/fs/cgroup); $(id)"
        if ! python3 -c "import nbgrader, nbclient" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
            stamp "installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
        fi
    } >"$out/machine.txt" 2>&1
    [ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    # A copy every user can read: graded kernels run as an unprivileged sandbox uid.
    rm -rf /opt/ddp-course && mkdir -p /opt/ddp-course && cp -a "$here"/. /opt/ddp-course/ && rm -rf /opt/ddp-course/.whl
    chmod -R a+rX /opt/ddp-course
    here=/opt/ddp-course
    export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH}
    mkdir -p /tmp/ddp-bin && printf '#!/bin/sh\nexec python3 -m course.cli "$@"\n' >/tmp/ddp-bin/ddp-course
    chmod 755 /tmp/ddp-bin/ddp-course && export PATH=/tmp/ddp-bin:$PATH
    python3 -c "import course, nbclient, nbgrader; print('imports ok')" >>"$out/machine.txt" 2>&1
fi
cd "$here" || exit 1
: >"$out/summary.txt"

parts=" ${GPU_CHECK_PARTS:-gpu sandbox verifier lessons} "
part() {  # part NAME SECONDS command...: run it if asked for, within its limit and what is left of the budget
    local name=$1 limit=$2
    shift 2
    [[ $parts == *" $name "* ]] || return 0
    local left=$((budget - ($(date +%s) - started)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        stamp "skip $name: the budget is spent" >>"$out/summary.txt"
        echo 124 >"$out/part-$name.exit"
        return 0
    fi
    stamp "start $name (limit ${limit}s): $*" >>"$out/summary.txt"
    if [ -n "$dry" ]; then
        echo 0 >"$out/part-$name.exit"
        return 0
    fi
    timeout -k 10 "$limit" "$@" >"$out/$name.log" 2>&1
    local code=$?
    echo "$code" >"$out/part-$name.exit"
    stamp "end $name: exit $code" >>"$out/summary.txt"
}

pytest=(python3 -m pytest -p no:cacheprovider -n 0 -rA)
export DDP_COURSE_GPU_REPORT=$out/lessons-on-nccl
part gpu 150 "${pytest[@]}" -m gpu tests/test_gpu.py -k "not lesson"
part sandbox 60 python3 benchmarks/gpu_check.py sandbox --json "$out/sandbox.json"
part verifier 180 python3 benchmarks/gpu_check.py verifier --policy auto --json "$out/verifier.json"
part lessons 240 "${pytest[@]}" -m gpu tests/test_gpu.py -k lesson
part policy 60 python3 benchmarks/gpu_check.py verifier --policy gloo --only ex1-parallelism --json "$out/policy.json"
if [ -d "$out/lessons-on-nccl" ]; then
    python3 -c "import json, pathlib, sys
rows = {p.name: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob('*.json'))}
print(json.dumps(rows, indent=1))" "$out/lessons-on-nccl" >"$out/lessons.json" 2>&1
    rm -rf "$out/lessons-on-nccl"
fi
stamp "done" >>"$out/summary.txt"
python3 benchmarks/gpu_check.py summary "$out" >>"$out/summary.txt"
code=$?
cat "$out/summary.txt"
exit $code
