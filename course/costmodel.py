"""What a training step's communication would cost on a real cluster: the alpha-beta model.

A message of ``b`` bytes over one link costs ``alpha + b / bandwidth`` seconds: ``alpha`` is the
latency every message pays (software, the network's round trip), ``bandwidth`` the bytes per second
of the link in one direction. A collective is a sequence of such steps; its cost follows from how many
steps it takes and how many bytes the busiest rank sends (Thakur, Rabenseifner and Gropp, "Optimization
of collective communication operations in MPICH", IJHPCA 2005; NCCL's "bus bandwidth" in
nccl-tests/doc/PERFORMANCE.md uses the same ring factors). For ``N`` ranks and a tensor of ``n`` bytes
(the whole tensor: the gathered result of an all-gather, the input of a reduce-scatter):

=================  ==========================  ==============================  ====================
collective         steps (each pays alpha)     bytes a rank sends (mean)       bytes the busiest
=================  ==========================  ==============================  ====================
ring all-reduce    2 (N - 1)                   2 (N - 1) / N x n               same
ring all-gather    N - 1                       (N - 1) / N x n                 same
ring reduce-scat.  N - 1                       (N - 1) / N x n                 same
ring broadcast     N - 1 (pipelined)           (N - 1) / N x n                 n
tree all-reduce    2 ceil(log2 N)              2 (N - 1) / N x n               ceil(log2 N) x n
                   (binomial reduce, then                                      (the root sends to
                   broadcast; unpipelined)                                     each child)
=================  ==========================  ==============================  ====================

A collective's time is ``steps x alpha + busiest bytes / bandwidth``. The ring's time grows with ``N``
only through its latency term; the tree's bandwidth term does not shrink with ``N`` but its latency
grows as ``log N``: small messages favour the tree, large ones the ring (lesson 1 plots the crossover).

What one training step runs (float32, steady state: after DDP's first-step bucket rebuild), measured
with torch 2.13 on gloo by ``tests/test_costmodel.py`` against :func:`step_collectives`:

* **DDP**: one all-reduce per bucket. Buckets take the gradients in the order they become ready
  (reverse ``model.parameters()`` order for a chain of layers); a bucket closes as soon as it holds at
  least ``bucket_cap_mb`` MiB, so the tensor that crosses the cap stays in it.
* **ZeRO** (``ZeroRedundancyOptimizer`` under DDP): DDP's all-reduces, then every parameter is
  broadcast once from the rank that owns its optimizer state.
* **FSDP2** (``fully_shard`` on each layer, then the root): every parameter is split on dim 0 into
  ``N`` equal pieces, padded to ``ceil(dim0 / N)`` rows; each layer is all-gathered before its forward,
  all-gathered again before its backward (it was resharded after forward), and its gradients are
  reduce-scattered: 3 (N - 1) / N x the padded size, per layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

FLOAT32 = 4


class Link(NamedTuple):
    """One rank's link to the next: latency per message (s) and bandwidth in one direction (bytes/s)."""

    alpha: float
    bandwidth: float
    source: str = ""


#: Link figures of a few real machines. Bandwidths are the vendors' figures per GPU and per direction;
#: latencies are assumptions of the usual order (a few microseconds inside a node, more across a
#: network), not datasheet figures: the model is for comparing plans, not for promising seconds.
MACHINES: dict[str, Link] = {
    "DGX H100 (NVLink 4)": Link(3e-6, 450e9, "NVIDIA H100 datasheet: NVLink 900 GB/s per GPU, both directions"),
    "DGX A100 (NVLink 3)": Link(3e-6, 300e9, "NVIDIA A100 datasheet: NVLink 600 GB/s per GPU, both directions"),
    "PCIe 4.0 x16": Link(5e-6, 31.5e9, "PCI-SIG PCIe 4.0: 16 GT/s x 16 lanes, 128b/130b coding"),
    "InfiniBand NDR 400 Gb/s": Link(5e-6, 50e9, "NVIDIA ConnectX-7: 400 Gb/s per port (one NIC per GPU)"),
    "Ethernet 100 Gb/s": Link(20e-6, 12.5e9, "IEEE 802.3 100GBASE: 100 Gb/s"),
    "Ethernet 10 Gb/s": Link(50e-6, 1.25e9, "IEEE 802.3 10GBASE: 10 Gb/s"),
}


class Cost(NamedTuple):
    """What a collective (or a step's collectives together) costs on a link."""

    bytes_sent: float  # bytes each rank sends, the mean over ranks
    seconds: float


def collective_cost(op: str, nbytes: float, world_size: int, link: Link, algorithm: str = "ring") -> Cost:
    """The cost of one collective on ``nbytes`` (the whole tensor) over ``world_size`` ranks."""
    n = world_size
    if n == 1:
        return Cost(0.0, 0.0)
    share = (n - 1) / n * nbytes
    if op == "all_reduce" and algorithm == "tree":
        steps = 2 * math.ceil(math.log2(n))
        return Cost(2 * share, steps * (link.alpha + nbytes / link.bandwidth))
    if algorithm != "ring":
        raise ValueError(f"no {algorithm!r} algorithm for {op}: the model has ring for every op, tree for all_reduce")
    if op == "all_reduce":
        return Cost(2 * share, 2 * (n - 1) * link.alpha + 2 * share / link.bandwidth)
    if op in ("all_gather", "reduce_scatter"):
        return Cost(share, (n - 1) * link.alpha + share / link.bandwidth)
    if op == "broadcast":
        return Cost(share, (n - 1) * link.alpha + nbytes / link.bandwidth)
    raise ValueError(f"the model has no cost for {op!r}")


def step_cost(collectives: Sequence[tuple[str, int]], world_size: int, link: Link,
              element_size: int = FLOAT32) -> Cost:
    """The total of ``(op, numel)`` collectives run one after the other (no overlap between them)."""
    costs = [collective_cost(op, numel * element_size, world_size, link) for op, numel in collectives]
    return Cost(sum(c.bytes_sent for c in costs), sum(c.seconds for c in costs))


# --- what a step runs -----------------------------------------------------------------------------------


def ddp_buckets(numels: Sequence[int], bucket_cap_mb: float, element_size: int = FLOAT32) -> list[int]:
    """DDP's buckets after its rebuild, in values: ``numels`` in ``model.parameters()`` order, taken in
    reverse; a bucket closes once it holds at least the cap."""
    cap, buckets, current = bucket_cap_mb * 2**20, [], 0
    for numel in reversed(list(numels)):
        current += numel
        if current * element_size >= cap:
            buckets.append(current)
            current = 0
    if current:
        buckets.append(current)
    return buckets


def fsdp_shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows rank ``rank`` holds of a parameter of ``rows`` rows that FSDP2 shards on dim 0: ``torch.chunk``'s
    split, ``ceil(rows / N)`` each, the last ranks fewer or none (the padding lives only in the all-gather)."""
    chunk = math.ceil(rows / world_size)
    return max(0, min(chunk, rows - rank * chunk))


def fsdp_padded_numel(shape: Sequence[int], world_size: int) -> int:
    """Values of one parameter once FSDP2 pads it for ``world_size`` shards: ``ceil(dim0 / N) x N`` rows (each
    rank's part of the all-gather is this divided by ``N``)."""
    rows = math.ceil(shape[0] / world_size) * world_size if shape else world_size
    return rows * math.prod(shape[1:])


def step_collectives(layers: Sequence[Sequence[Sequence[int]]], world_size: int, strategy: str,
                     bucket_cap_mb: float = 25.0) -> list[tuple[str, int]]:
    """The collectives of one steady-state step, as ``(op, numel of the whole tensor)``.

    ``layers``: each layer's parameter shapes, in ``model.parameters()`` order (one FSDP unit each).
    """
    shapes = [tuple(s) for layer in layers for s in layer]
    numels = [math.prod(s) for s in shapes]
    if strategy == "ddp":
        return [("all_reduce", b) for b in ddp_buckets(numels, bucket_cap_mb)]
    if strategy == "zero":
        return [("all_reduce", b) for b in ddp_buckets(numels, bucket_cap_mb)] + [("broadcast", n) for n in numels]
    if strategy == "fsdp":
        padded = [sum(fsdp_padded_numel(s, world_size) for s in layer) for layer in layers if layer]
        return ([("all_gather", p) for p in padded] * 2) + [("reduce_scatter", p) for p in padded]
    raise ValueError(f"strategy is one of 'ddp', 'zero', 'fsdp', not {strategy!r}")
