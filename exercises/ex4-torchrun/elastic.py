"""Train with DDP in a job whose world size changes; checkpoint every step; continue at any world size.

Run:  torchrun --nnodes=1:2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT elastic.py --out OUT_DIR --ckpt CKPT_PATH
"""
import torch
import torch.nn as nn

# ---- given: the model, the data, the optimizer (do not change these) ----
EPOCHS = 2
SAMPLES = 24
GLOBAL_BATCH = 6
LR = 0.05
MOMENTUM = 0.9


def make_model():
    """The tiny model: the same initial weights in every process."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def make_optimizer(model):
    """SGD with momentum: the optimizer has state."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def make_dataset():
    """SAMPLES samples (x, y), the same in every process."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(SAMPLES, 4, generator=g)
    return torch.utils.data.TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


def loss_fn(prediction, y):
    return nn.functional.mse_loss(prediction, y)


# ---- yours ----
### BEGIN SOLUTION
import argparse
import os

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEPS_PER_EPOCH = SAMPLES // GLOBAL_BATCH


def save_checkpoint(state, ckpt_path):
    """Replace ckpt_path in one step: a kill during the write leaves the previous checkpoint whole."""
    tmp_path = ckpt_path + ".tmp"
    torch.save(state, tmp_path)
    os.replace(tmp_path, ckpt_path)


def samples_of(rank, world_size, done):
    """The dataset indices rank `rank` trains on at the job's step number `done` (counted over all epochs).

    The epoch's order depends on the epoch only, and a step is the same GLOBAL_BATCH samples at every
    world size: only how they are split over the ranks depends on world_size."""
    epoch, step = divmod(done, STEPS_PER_EPOCH)
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(epoch))
    batch = order[step * GLOBAL_BATCH:(step + 1) * GLOBAL_BATCH]
    return batch.chunk(world_size)[rank]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])  # read at start: this round's size, not the job's first
    use_cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")

    dataset = make_dataset()
    model = make_model().to(device)
    optimizer = make_optimizer(model)
    done = 0  # optimizer steps of the whole job so far, whatever the world size was
    if os.path.exists(args.ckpt):  # every worker, a joining node's too (its restart count is 0)
        saved = torch.load(args.ckpt, map_location=device)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        done = saved["done"]
    ddp_model = DDP(model, device_ids=[local_rank] if use_cuda else None)

    while done < EPOCHS * STEPS_PER_EPOCH:
        x, y = dataset[samples_of(rank, world_size, done)]
        loss = loss_fn(ddp_model(x.to(device)), y.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done += 1
        if rank == 0:
            save_checkpoint({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "done": done},
                            args.ckpt)

    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
### END SOLUTION
