# Part 3 of find_the_hang.ipynb: a training function that hangs. Run it, find why, then fix it in the notebook.
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def train_early(rank, world_size, model, train_set, val_set, log, out_dir, epochs=2, batch_size=4, lr=0.1):
    """Train `model` with DDP; then every rank predicts the classes of its part of the validation set and
    writes them to `out_dir`, and rank 0 merges the files into the validation accuracy it logs."""
    device = next(model.parameters()).device
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)
    for _ in range(epochs):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(ddp_model(x.to(device)), y.to(device)).backward()
            optimizer.step()

    chunk = math.ceil(len(val_set) / world_size)  # each rank predicts one contiguous chunk
    mine = range(rank * chunk, min(len(val_set), (rank + 1) * chunk))
    if len(mine) == 0:
        return  # nothing to predict on this rank
    model.eval()
    with torch.no_grad():
        x = torch.stack([val_set[i][0] for i in mine]).to(device)
        preds = model(x).argmax(dim=1).cpu()
    torch.save({"indices": list(mine), "preds": preds}, os.path.join(out_dir, f"preds{rank}.pt"))
    dist.barrier()  # every rank's file is complete before rank 0 reads them

    if rank == 0:
        right = 0
        for r in range(world_size):
            path = os.path.join(out_dir, f"preds{r}.pt")
            if os.path.exists(path):
                part = torch.load(path, weights_only=True)
                right += sum(int(p) == int(val_set[i][1]) for i, p in zip(part["indices"], part["preds"]))
        log({"val_accuracy": right / len(val_set)})
