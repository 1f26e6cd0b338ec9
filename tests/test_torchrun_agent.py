"""torchrun's agent as the launcher starts it (course.launcher.torchrun.agent): workers forked from a warm zygote.

The checks built on it (every torchrun and elastic launch of exercise 4) are graded end to end by
test_graders_ex4*.py; here: that the workers really are forked, that a forked worker sees what an exec'd one
would, that the switch off (DDP_COURSE_ZYGOTE=0) exec's them as before, that the zygote imports what a worker's first
optimizer would, and that the probe keeps every group a script destroys (torch's teardown of a group could hang a
worker at its end).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import graders.common.torchrun_model as torchrun_model
from course.launcher.torchrun import agent, agents, runner

#: a DDP job that ends as most scripts do: destroy_process_group, then its model freed as main() returns (the
#: moment torch 2.13 can hang in ~ProcessGroupGloo, when the probe does not keep the group)
SCRIPT = textwrap.dedent('''
    import argparse, json, os, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    def main(args):
        dist.init_process_group("gloo")
        model = DDP(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), os.path.join(args.out, "final.pt"))
        print("SEEN " + json.dumps({
            "cmdline": open("/proc/self/cmdline", "rb").read().decode().split("\\0"),
            "name": __name__, "argv": sys.argv, "path0": sys.path[0], "rank": os.environ["RANK"],
            "agent": os.environ.get("DDP_COURSE_PROBE_AGENT"), "ppid": os.getppid(),
            "grandparent": int(open(f"/proc/{os.getppid()}/stat").read().rsplit(")", 1)[1].split()[1]),
            "agent_parent": int(open(f"/proc/{os.environ['DDP_COURSE_PROBE_AGENT']}/stat").read()
                                .rsplit(")", 1)[1].split()[1]),
            "omp": os.environ.get("OMP_NUM_THREADS"), "threads": torch.get_num_threads(),
            # what get_batch(rank, 0, 0) draws here: moved by this worker's secret under the grader's prelude
            "drawn": torch.randn(8, 4, generator=torch.Generator().manual_seed(dist.get_rank())).tolist()}),
            flush=True)
        world = dist.group.WORLD
        dist.destroy_process_group()
        kept = dist.destroy_process_group.__globals__.get("_KEEP_ALIVE", [])  # the probe's, where it patched destroy
        print("KEPT " + json.dumps({"world": any(g is world for g in kept), "groups": len(kept)}), flush=True)

    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("--out")
        parser.add_argument("--ckpt")
        main(parser.parse_args())
''')


def _seen(run) -> dict[int, dict]:
    return {int(w.rank): json.loads(line.split("SEEN ", 1)[1]) for w in run.workers
            for line in w.output.splitlines() if line.startswith("SEEN ")}


def test_only_the_probes_worker_command_is_forked():
    probe = runner.PROBE_SCRIPT
    assert agent.forked_argv((sys.executable, "-u", probe, "train.py", "--out", "o")) == [
        sys.executable, "-u", "-m", agent.PROBE_MODULE, "train.py", "--out", "o"]
    assert agent.forked_argv((sys.executable, "-u", "train.py")) is None  # not the probe: exec'd
    assert agent.forked_argv(("/usr/bin/python3", "-u", probe)) is None  # another interpreter
    assert agent.forked_argv((sys.executable, probe)) is None  # not as torchrun starts it


def test_the_zygote_imports_what_a_workers_first_optimizer_would():
    """A worker's first optimizer (or DDP model) imports torch._dynamo (about 0.8 CPU s, most of a small worker's
    cost): the zygote imports it once per agent, so a forked worker's first optimizer imports nothing more."""
    assert "torch._dynamo" in agent.PRELOAD
    code = ("import importlib, sys\n"
            f"for name in {agent.PRELOAD!r}: importlib.import_module(name)\n"
            "import torch\n"
            "before = set(sys.modules)\n"
            "torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)\n"
            "print(sorted(m for m in set(sys.modules) - before if m.startswith('torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "exec'd"])
def test_a_two_node_job_runs_as_under_torchrun(tmp_path, monkeypatch, forked):
    """Two agents (2 + 1 workers): each worker runs the script as __main__ with torchrun's environment and the
    script's folder first on sys.path; forked, it is the agent's grandchild (its zygote, forked from the agent, in between) and
    knows its agent; with DDP_COURSE_ZYGOTE=0 each worker is exec'd by its agent. The agent with one worker forks it too (its
    zygote, forked from the agent, costs less than one exec'd worker). The agents themselves are forked from this
    process's agent zygote (course.launcher.torchrun.agents), or exec'd with DDP_COURSE_ZYGOTE=0."""
    if not forked:
        monkeypatch.setenv("DDP_COURSE_ZYGOTE", "0")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT + ("" if forked else "# exec'd\n"))  # another content: not the forked run's cache
    run = runner.run_script(str(script), "nodes", layout=(2, 1), prelude="graders.common.torchrun_model:install")
    assert run.ok, run.log + "\n".join(f"--- {w.name} ---\n{w.output[-2000:]}" for w in run.workers)
    assert isinstance(run.final, dict) and set(run.final) == {"weight", "bias"}, run.final
    seen = _seen(run)
    assert sorted(seen) == [0, 1, 2], [w.output for w in run.workers]
    per_agent = {a: sum(1 for s in seen.values() if s["agent"] == a) for a in {s["agent"] for s in seen.values()}}
    assert sorted(per_agent.values()) == [1, 2], per_agent  # two agents, each its workers'
    for rank, s in seen.items():
        assert s["name"] == "__main__" and s["argv"][0] == str(script) and s["path0"] == str(tmp_path), s
        assert s["rank"] == str(rank) and s["omp"] == "1" and s["threads"] == 1, s
        if forked:
            # forked from the zygote, itself forked from the agent, itself forked from the launcher's agent zygote:
            # that zygote's command line, not an exec's (an exec'd worker's: python -u PROBE_SCRIPT)
            assert "course.sandbox.zygote" in s["cmdline"] and runner.PROBE_SCRIPT not in s["cmdline"], s
            assert s["grandparent"] == int(s["agent"]), s
            assert s["agent_parent"] in {z.pid for z in agents._zygotes.values()}, s
        else:
            assert runner.PROBE_SCRIPT in s["cmdline"] and s["ppid"] == int(s["agent"]), s
            assert s["agent_parent"] == os.getpid(), s  # exec'd by this process (through the death-signal shim)
    # every worker, forked or exec'd, got a secret of its own that the launcher was told (its zygote's, or its
    # agent's on a pipe), and the prelude moved its own batch by exactly that secret's offset
    forks = {pid: (rank, secret) for pid, rank, secret in run.forks}
    assert sorted(forks) == sorted(w.pid for w in run.workers), (run.forks, [w.pid for w in run.workers])
    assert len({secret for _, secret in forks.values()}) == 3 and None not in {s for _, s in forks.values()}
    for w in run.workers:
        rank, secret = forks[w.pid]
        assert rank == w.rank
        wanted = torchrun_model.batch_of(rank, 0, 0, secret)[0]
        assert torch.allclose(torch.tensor(seen[rank]["drawn"]), wanted, atol=1e-6), rank
        assert not torch.allclose(wanted, torchrun_model.get_batch(rank, 0, 0)[0])
    # every worker's probe kept the groups its script destroyed until the worker ended: torch's teardown of a group
    # that a DDP model's reducer frees (joining gloo's threads holding the GIL) is what hung workers at their end
    kept = [json.loads(line.split("KEPT ", 1)[1]) for w in run.workers for line in w.output.splitlines()
            if line.startswith("KEPT ")]
    assert kept == [{"world": True, "groups": 1}] * 3, kept
    assert not os.path.exists(run.out_dir)  # the job folder is gone: nothing left behind
