# Part 1 of find_the_hang.ipynb: a training function that hangs. Run it, find why, then fix it in the notebook.
# train_metric is given and right; the hang is in log_val_loss, the function you fix (same name and signature).
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def log_val_loss(rank, world_size, totals, log, epoch, log_rank):
    """Called by every rank after every epoch. `totals` holds this rank's share of the validation set: its summed
    loss and its number of samples. Rank `log_rank` logs the validation loss over the whole validation set."""
    if rank == log_rank:
        dist.reduce(totals, dst=log_rank)  # the totals of all ranks, summed on the logging rank
        log({"epoch": epoch, "val_loss": (totals[0] / totals[1]).item()})


def train_metric(rank, world_size, model, train_set, val_set, log, epochs=2, batch_size=4, lr=0.1, log_rank=0,
                 log_val_loss=log_val_loss):
    """Train `model` with DDP; after every epoch, rank `log_rank` logs the validation loss over the whole
    validation set (the mean cross-entropy of every validation sample)."""
    device = next(model.parameters()).device
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler)

    for epoch in range(epochs):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()

        model.eval()
        totals = torch.zeros(2, device=device)  # this rank's summed loss and its number of samples
        with torch.no_grad():
            for i in range(rank, len(val_set), world_size):
                x, y = val_set[i]
                totals[0] += F.cross_entropy(model(x[None].to(device)), y[None].to(device), reduction="sum")
                totals[1] += 1
        log_val_loss(rank, world_size, totals, log, epoch, log_rank)
