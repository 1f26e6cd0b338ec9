"""The check API's refusal of the grader's own reference code (course.checks.refuse, course/checks/sealing.py): once
called in a process, the given functions' code refuses to run wherever a copy of it lives, and no new copy can be
made of its code object or its source; code written independently, however alike, still runs.

Each case runs in a fresh interpreter: a refusal lasts for the process (an audit hook cannot be removed)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent('''
    import inspect, json, textwrap, types
    import cloudpickle
    import course.costmodel as cm
    from course import checks
    from course.checks.sealing import fingerprint

    source = inspect.getsource(cm)                                   # read before the refusal
    by_value = dict(vars(cm))
    by_value.update({k: types.FunctionType(v.__code__, by_value, k, v.__defaults__)
                     for k, v in vars(cm).items() if isinstance(v, types.FunctionType)})
    code = cm.ddp_buckets.__code__
    bound = cm.ddp_buckets
    cloudpickle.register_pickle_by_value(cm)
    pickled = cloudpickle.loads(cloudpickle.dumps(cm.ddp_buckets))   # a copy of the module's function, by value

    MINE = """
    def mine(numels, bucket_cap_mb, element_size=4):  # the same loop, written by a student
        cap, buckets, current = bucket_cap_mb * 2**20, [], 0
        for numel in reversed(list(numels)):
            current += numel
            if current * element_size >= cap:
                buckets.append(current)
                current = 0
        if current:
            buckets.append(current)
        return buckets
    """
    exec(textwrap.dedent(MINE))

    found = checks.refuse([cm.ddp_buckets], "refused: the grader's model")
    out = {"found": found, "alike": fingerprint(mine.__code__) == fingerprint(code)}

    def attempt(name, fn):
        try:
            out[name] = fn()
        except RuntimeError as err:
            out[name] = "refused" if "grader's model" in str(err) else repr(err)

    attempt("module", lambda: cm.ddp_buckets([1, 2], 1.0))
    attempt("bound", lambda: bound([1, 2], 1.0))
    attempt("by_value", lambda: by_value["ddp_buckets"]([1, 2], 1.0))
    attempt("pickled", lambda: pickled([1, 2], 1.0))
    attempt("from_code", lambda: types.FunctionType(code, {"FLOAT32": 4}, None, (4,))([1, 2], 1.0))
    attempt("renamed_code", lambda: types.FunctionType(code.replace(co_name="other", co_firstlineno=9),
                                                       {"FLOAT32": 4}, None, (4,))([1, 2], 1.0))
    attempt("source", lambda: exec(source, {"__name__": "copy"}))
    attempt("function_source", lambda: exec(textwrap.dedent(MINE).replace("mine", "x"), {}))
    attempt("mine", lambda: mine([1, 2], 1.0))
    attempt("other", lambda: cm.fsdp_shard_rows(10, 3, 2))
    print(json.dumps(out))
''')


def test_every_copy_of_refused_code_refuses_and_independent_code_runs():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # the module's function, a reference bound earlier, copies by value (FunctionType, cloudpickle's by-value
    # module): every one found and refused
    assert out["found"] >= 3, out
    for name in ("module", "bound", "by_value", "pickled", "from_code", "renamed_code", "source"):
        assert out[name] == "refused", (name, out)
    # a student's own code runs, even the same loop with other names; so does what was not refused
    assert out["alike"] is False
    assert out["mine"] == [3] and out["function_source"] is None and out["other"] == 2, out
