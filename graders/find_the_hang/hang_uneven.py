# Part 2 of find_the_hang.ipynb: a training function that hangs. Run it, find why, then fix it in the notebook.
# train_uneven is given and right; the hang comes from share_of, the function you fix (same name and signature).
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset


def share_of(rank, world_size, n):
    """The indices (of the n training samples) that rank `rank` trains on in every epoch. Every training sample
    counts: each one must be in some rank's share."""
    return list(range(rank, n, world_size))  # each sample on exactly one rank


def train_uneven(rank, world_size, model, train_set, val_set, log, epochs=2, batch_size=4, lr=0.1, share_of=share_of):
    """Train `model` with DDP for `epochs` epochs, each rank on its share of the training set (`share_of`); rank 0
    logs the epoch's mean training loss."""
    device = next(model.parameters()).device
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    loader = DataLoader(Subset(train_set, share_of(rank, world_size, len(train_set))), batch_size=batch_size)

    for epoch in range(epochs):
        model.train()
        losses = []
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        if rank == 0:
            log({"epoch": epoch, "train_loss": sum(losses) / len(losses)})
