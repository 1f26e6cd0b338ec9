"""The jobs the launcher benchmark times, importable by every start method."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_reduce(rank: int) -> float:
    dist.init_process_group("gloo")
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def ddp_step(rank: int) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    ddp_model = DDP(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    x = torch.randn(8, 16) + rank
    ddp_model(x).pow(2).mean().backward()
    opt.step()
    value = ddp_model.module.weight.sum().item()
    del ddp_model, opt  # free DDP before the group (DESIGN.md teardown trap)
    dist.destroy_process_group()
    return value


WORKLOADS = {"all_reduce": all_reduce, "ddp_step": ddp_step}


def with_env(rank: int, name: str, world_size: int, port: int) -> None:
    """Entry for mp.spawn / fork: set the torchrun environment, then run the workload."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    WORKLOADS[name](rank)


if __name__ == "__main__":  # under torchrun
    WORKLOADS[sys.argv[1]](int(os.environ["RANK"]))
