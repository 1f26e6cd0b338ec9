#!/usr/bin/env bash
# The nccl path on a GPU machine, in one go, with every part bounded in time.
#
#   bash benchmarks/gpu_check.sh [OUTDIR]        (GPU_CHECK_PARTS="grade sandbox" runs only those parts)
#
# Runs, side by side: tests/test_gpu.py (nccl jobs, DDP and SyncBatchNorm on the GPUs against
# a CPU reference, every lesson's rank functions as nccl ranks), the four lesson tests with a GPU
# visible, `ddp-course grade` on the four reference solutions, and the sandbox's containment
# tests (the machine's cgroup version). Logs go to OUTDIR (default $OUT or
# /tmp/ddp-course-gpu). Python packages the machine lacks can come as wheels in .whl/.
set -u
out=${1:-${OUT:-/tmp/ddp-course-gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
started=$(date +%s)
stamp() { echo "[gpu-check $(($(date +%s) - started))s] $*"; }

{
    stamp "machine"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"
    echo "cpus $(nproc); cgroup fs $(stat -fc %T /sys/fs/cgroup); $(id)"
    if ! python3 -c "import nbgrader, nbclient" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
        stamp "installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    fi
} >"$out/machine.txt" 2>&1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site

# A copy every user can read: graded kernels run as an unprivileged sandbox uid.
rm -rf /opt/ddp-course && mkdir -p /opt/ddp-course && cp -a . /opt/ddp-course/ && rm -rf /opt/ddp-course/.whl
chmod -R a+rX /opt/ddp-course
cd /opt/ddp-course || exit 1
export PYTHONPATH=/opt/ddp-course${PYTHONPATH:+:$PYTHONPATH}
mkdir -p /tmp/ddp-bin && printf '#!/bin/sh\nexec python3 -m course.cli "$@"\n' >/tmp/ddp-bin/ddp-course
chmod 755 /tmp/ddp-bin/ddp-course && export PATH=/tmp/ddp-bin:$PATH
python3 -c "import course, nbclient, nbgrader; print('imports ok')" >>"$out/machine.txt" 2>&1

parts=" ${GPU_CHECK_PARTS:-gpu lessons grade sandbox} "
part() {  # part NAME SECONDS pytest-args...
    local name=$1 limit=$2
    shift 2
    [[ $parts == *" $name "* ]] || return 0
    stamp "start $name" >>"$out/summary.txt"
    timeout -k 10 "$limit" python3 -m pytest -p no:cacheprovider -n 0 -rA "$@" >"$out/$name.log" 2>&1
    stamp "end $name: exit $?" >>"$out/summary.txt"
}

export DDP_COURSE_GPU_REPORT=$out/lessons-on-nccl
part gpu 480 -m gpu tests/test_gpu.py tests/test_launch.py -s &
part lessons 300 tests/test_lesson1.py tests/test_lesson2.py tests/test_lesson3.py tests/test_lesson4.py &
grade_all() {  # `ddp-course grade --json` on each reference solution, side by side
    [[ $parts == *" grade "* ]] || return 0
    stamp "start grade" >>"$out/summary.txt"
    for nb in exercises/*/*.ipynb; do
        name=/tmp/grade-$(basename "$nb" .ipynb)
        (timeout -k 10 300 ddp-course grade --json "$nb" >"$name.json" 2>"$name.err"
            echo "$nb: exit $?" >"$name.exit") &
    done
    wait
    for f in /tmp/grade-*.exit; do cat "$f" "${f%.exit}.err" "${f%.exit}.json"; done >"$out/grade.log"
    python3 -c "import json, pathlib
for f in sorted(pathlib.Path('/tmp').glob('grade-*.json')):
    try:
        r = json.loads(f.read_text())
        print(f.stem, r['score'], '/', r['max_score'], r['notes'])
    except ValueError:
        print(f.stem, 'no JSON report')" >>"$out/summary.txt"
    stamp "end grade" >>"$out/summary.txt"
}
grade_all &
part sandbox 240 tests/adversarial/test_sandbox.py &
wait
if [ -d "$out/lessons-on-nccl" ]; then
    python3 -c "import json, pathlib, sys
rows = {p.name: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob('*.json'))}
print(json.dumps(rows, indent=1))" "$out/lessons-on-nccl" >"$out/lessons-on-nccl.json" 2>&1
    rm -rf "$out/lessons-on-nccl"
fi
stamp "done" >>"$out/summary.txt"
cat "$out/summary.txt"
tail -n 3 "$out"/*.log
