# Part 2 of find_the_hang.ipynb: a training function that hangs. Run it, find why, then fix it in the notebook.
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset


def train_uneven(rank, world_size, model, train_set, val_set, log, epochs=2, batch_size=4, lr=0.1):
    """Train `model` with DDP for `epochs` epochs. Every training sample counts: in every epoch each sample is
    trained on (by some rank); rank 0 logs the epoch's mean training loss."""
    device = next(model.parameters()).device
    ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)
    share = Subset(train_set, range(rank, len(train_set), world_size))  # each sample on exactly one rank
    loader = DataLoader(share, batch_size=batch_size)

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
