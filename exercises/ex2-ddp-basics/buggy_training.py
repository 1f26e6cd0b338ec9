# A complete DDP training script with four bugs in it. In the notebook's answer cell, run
#     %load buggy_training.py
# (Jupyter replaces the cell with this file), then find and fix them.
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset


def evaluate(model, dataset, rank, world_size, device):
    """The accuracy of `model` on `dataset`: each rank evaluates every world_size-th sample."""
    share = Subset(dataset, range(rank, len(dataset), world_size))
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(share, batch_size=8):
            correct += (model(x.to(device)).argmax(dim=1) == y.to(device)).sum().item()
    accuracy = torch.tensor([correct / len(share)], device=device)
    dist.all_reduce(accuracy)
    return accuracy.item() / world_size


def train_epoch(ddp_model, loader, optimizer, device):
    """One pass over `loader`: a step of `optimizer` on the cross-entropy of every batch."""
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp_model(x), y)
        loss.backward()
        optimizer.step()


def main(rank, world_size, model, train_set, val_set, ckpt_path, log, epochs=3, batch_size=4, lr=0.1):
    """Train `model` (already on this rank's device; the process group is set up) on `train_set` with DDP,
    log the validation accuracy after every epoch from rank 0, save a checkpoint at the end."""
    device = next(model.parameters()).device
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)

    for epoch in range(epochs):
        ddp_model.train()
        train_epoch(ddp_model, loader, optimizer, device)
        accuracy = evaluate(ddp_model.module, val_set, rank, world_size, device)
        if rank == 0:
            log({"epoch": epoch, "accuracy": accuracy})

    if rank == 0:
        torch.save({"epoch": epochs, "model": ddp_model.state_dict()}, ckpt_path)
        dist.barrier()  # the other ranks must not go on before the checkpoint is written
