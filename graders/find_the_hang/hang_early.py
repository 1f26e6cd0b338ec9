# Part 3 of find_the_hang.ipynb: a training function that hangs. Run it, find why, then fix it in the notebook.
# train_early, predict and merged_accuracy are given and right; the hang is in predict_and_merge, the function you
# fix (same name and signature).
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def predict_and_merge(rank, world_size, model, val_set, log, out_dir):
    """Called by every rank after training: rank r predicts the classes of its chunk of the validation set (chunks
    of ceil(n / world_size) samples, in order) and saves them in `out_dir`; rank 0 logs the merged accuracy."""
    chunk = math.ceil(len(val_set) / world_size)
    mine = range(rank * chunk, min(len(val_set), (rank + 1) * chunk))
    if len(mine) == 0:
        return  # nothing to predict on this rank
    preds = predict(model, val_set, mine)
    torch.save({"indices": list(mine), "preds": preds}, os.path.join(out_dir, f"preds{rank}.pt"))
    dist.barrier()  # every rank's file is complete before rank 0 reads them
    if rank == 0:
        log({"val_accuracy": merged_accuracy(world_size, val_set, out_dir)})


def predict(model, val_set, indices):
    """The classes `model` predicts for the validation samples `indices` (at least one), as a CPU tensor."""
    device = next(model.parameters()).device
    model.eval()
    with torch.no_grad():
        x = torch.stack([val_set[i][0] for i in indices]).to(device)
        return model(x).argmax(dim=1).cpu()


def merged_accuracy(world_size, val_set, out_dir):
    """The validation accuracy of the prediction files `preds<rank>.pt` in `out_dir` (a sample no file predicts
    counts as wrong)."""
    right = 0
    for r in range(world_size):
        path = os.path.join(out_dir, f"preds{r}.pt")
        if os.path.exists(path):
            part = torch.load(path, weights_only=True)
            right += sum(int(p) == int(val_set[i][1]) for i, p in zip(part["indices"], part["preds"]))
    return right / len(val_set)


def train_early(rank, world_size, model, train_set, val_set, log, out_dir, epochs=2, batch_size=4, lr=0.1,
                predict_and_merge=predict_and_merge):
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
    predict_and_merge(rank, world_size, model, val_set, log, out_dir)
