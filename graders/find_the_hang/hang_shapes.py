# Part 4 of find_the_hang.ipynb: a training function that hangs. Run it, find why, then fix it in the notebook.
# train_shapes is given and right; the hang comes from class_counts, the function you fix (same name and signature).
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def class_counts(logits, y):
    """This rank's counts per class, for the validation samples it holds: `logits` (one row per sample, one column
    per class the model predicts) and `y` (their labels). Returns (seen, right): per class, the samples of that
    class, and those of them predicted right."""
    hits = (logits.argmax(dim=1) == y).float()
    seen = torch.bincount(y).float()  # per class: this rank's samples
    right = torch.bincount(y, weights=hits)  # per class: those predicted right
    return seen, right


def train_shapes(rank, world_size, model, train_set, val_set, log, epochs=2, batch_size=4, lr=0.1,
                 class_counts=class_counts):
    """Train `model` with DDP; then rank 0 logs the validation accuracy of every class (right / samples of that
    class, over the whole validation set), a list with one number per class."""
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

    model.eval()
    mine = range(rank, len(val_set), world_size)
    with torch.no_grad():
        x = torch.stack([val_set[i][0] for i in mine]).to(device)
        y = torch.stack([val_set[i][1] for i in mine]).to(device)
        seen, right = class_counts(model(x), y)
    dist.all_reduce(seen)  # summed over the ranks
    dist.all_reduce(right)
    if rank == 0:
        log({"class_accuracy": (right / seen).tolist()})
