"""Part 1 of exercise 2's practice notebook: the k hardest samples of the whole dataset (:func:`check_hardest`).

The student writes ``hardest(model, dataset, rank, world_size, sample_losses, k)``: the dataset indices of the k
samples with the highest loss, the highest first, the same list on every rank, each sample put through the model
on exactly one rank. The loss loop is given (``sample_losses(model, samples)``: each sample's cross-entropy, in the
order of ``samples``); which samples a rank evaluates and how the ranks' candidates meet is the student's.

What the check observes, never what the student's process says about itself:

* which samples each rank's model evaluated: the grader's model records every input its forward is given;
* the list each rank returned, judged in the grader's process against the losses it computes itself: a valid
  answer is any list of k distinct indices, in order of loss, none of whose losses is below a loss left out (so
  that two losses equal to float32's rounding are never a reason to fail);
* where the others' losses came from: a second run calls the function :data:`SECOND_CALLS` times on the same inputs,
  each time with labels every rank draws for its own share alone from the OS's randomness (no other rank, and no
  seed, knows them), its copy of the other samples labelled with their worst class. Only a rank that ranks its own
  share and receives the others' candidates returns every call's list; one that evaluates the others' samples
  itself, or returns a list it kept, does not.
"""

from __future__ import annotations

import functools
import math
import numbers
import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from course import checks
from course.checks import CheckFailed, passed
from graders.ddp_in_practice.harness import _SEEN, CLASSES, Classifier

_REAL = checks.REAL
#: how many times the second run calls hardest, each time with new labels of each rank's own drawing
SECOND_CALLS = 16
#: losses closer than this may come out in either order (float32 on the ranks, float64 here)
TOLERANCE = 1e-4
#: the first run's data keeps consecutive losses of the answer (and the first loss left out) this far apart
GAP = 1e-2


def sample_losses(model, samples, batch_size):
    """The exercise's given loss loop: each sample's cross-entropy under ``model``, a float tensor on the model's
    device in the order of ``samples`` (any dataset of (x, y) pairs, e.g. a Subset), in batches of at most
    ``batch_size``, without gradients. The student's hardest gets it with ``batch_size`` bound."""
    device = next(model.parameters()).device
    out = [torch.zeros(0, device=device)]
    with torch.no_grad():
        for x, y in DataLoader(samples, batch_size=batch_size):
            out.append(F.cross_entropy(model(x.to(device)), y.to(device), reduction="none"))
    return torch.cat(out)


def _inputs(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(900 + seed)
    return torch.randn(n, 4, generator=gen) * 2


def losses_of(n: int, seed: int, labels) -> list[float]:
    """Each sample's cross-entropy for ``labels`` (a sequence of n classes), in float64, in the grader's process."""
    model = Classifier(seed).double()
    with torch.no_grad():
        logits = model.linear(_inputs(n, seed).double())
    return F.cross_entropy(logits, torch.tensor(list(labels)), reduction="none").tolist()


def _worst(n: int, seed: int) -> list[int]:
    """Each sample's class of highest loss (the label a rank's copy gives the samples outside its share)."""
    model = Classifier(seed)
    with torch.no_grad():
        return model.linear(_inputs(n, seed)).argmin(dim=1).tolist()


def top(losses: list[float], k: int) -> list[int]:
    return sorted(range(len(losses)), key=lambda i: -losses[i])[:k]


def _splits(n: int, world_size: int) -> dict[str, list[list[int]]]:
    """How students split n samples over the ranks: each rank's sample indices."""
    padded = [list(DistributedSampler(range(n), num_replicas=world_size, rank=r, shuffle=False))
              for r in range(world_size)]
    chunked = [c.tolist() for c in torch.tensor_split(torch.arange(n), world_size)]
    return {"strided": [list(range(r, n, world_size)) for r in range(world_size)], "chunked": chunked,
            "padded": padded}


def _separated(losses: list[float], k: int) -> bool:
    ranked = sorted(losses, reverse=True)[:k + 1]
    return all(a - b > GAP for a, b in zip(ranked, ranked[1:]))


@functools.cache
def hard_case(n: int, world_size: int, k: int, seed: int) -> tuple[int, ...]:
    """The first run's labels: the answer's losses well apart, and for every usual split the answer holds samples
    of at least two ranks and no rank's own k hardest is it (so a rank that ranks only its share is wrong)."""
    if not 2 <= k < n:
        raise ValueError(f"k={k}: ask for at least 2 and fewer than n={n} samples")
    gen = torch.Generator().manual_seed(800 + seed)
    for _ in range(5000):
        labels = torch.randint(CLASSES, (n,), generator=gen).tolist()
        losses = losses_of(n, seed, labels)
        if not _separated(losses, k):
            continue
        want = top(losses, k)
        ok = True
        for split in _splits(n, world_size).values():
            owners = {r for r, s in enumerate(split) for i in s if i in want}
            local = [sorted(set(s), key=lambda i: -losses[i])[:k] for s in split]
            ok = ok and len(owners) >= 2 and all(loc != want for loc in local)
        if ok:
            return tuple(labels)
    raise ValueError(f"no data for n={n}, world_size={world_size}, k={k}")  # pragma: no cover - the checks' sizes find one


def _private_labels(n: int, seed: int, share: list, calls: int, _urandom=os.urandom) -> tuple:
    """This rank's copy of the labels for each call of the second run, drawn from the OS's randomness (``os.urandom``
    taken at import) before any student code runs in the call: its own share's labels drawn uniformly, every other
    sample labelled with its worst class. Returns per call ``(mine, labels)``: ``mine`` the share's labels (for the
    grader), ``labels`` the whole copy (tuples: they cannot be changed in place)."""
    worst = _worst(n, seed)
    mine = sorted(set(share))
    out = []
    for _ in range(calls):
        raw = _urandom(n)
        drawn = {i: raw[i] % CLASSES for i in mine}
        out.append((tuple(sorted(drawn.items())), tuple(drawn.get(i, worst[i]) for i in range(n))))
    return tuple(out)


def _indices(value):
    """A returned list of dataset indices as a list of ints, or a description of what it was instead."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().reshape(-1).tolist() if value.dim() <= 1 else value
    if hasattr(value, "tolist") and not isinstance(value, torch.Tensor):  # numpy arrays
        value = value.tolist()
    def whole(v) -> bool:  # an int, or a float that is one (indices that travelled in a float tensor)
        return not isinstance(v, bool) and (isinstance(v, numbers.Integral)
                                            or isinstance(v, numbers.Real) and float(v).is_integer())

    if isinstance(value, (list, tuple)) and all(whole(v) for v in value):
        return [int(v) for v in value]
    if isinstance(value, (list, tuple)):
        kinds = sorted({type(v).__name__ for v in value})
        return f"<{type(value).__name__} of {', '.join(kinds) or 'nothing'}>"
    return f"<{type(value).__name__}>"


def _hardest_harness(rank, hardest, n, k, batch_size, seed, shares=None, _world_size=_REAL.get_world_size,
                     _draw=_private_labels, _seen=_SEEN):
    """Run hardest on this rank's copy of the dataset; record the samples its model evaluated. ``shares`` (the second
    run): the samples each rank evaluated in the first; hardest is then called SECOND_CALLS times, each time with
    labels this rank drew itself (returned as ``mine``). The harness's own references are default arguments, bound
    when this module was first imported."""
    import random

    import numpy

    dev = checks.join_job()
    world_size = _world_size()
    x = _inputs(n, seed)
    draws = _draw(n, seed, shares[rank], SECOND_CALLS) if shares is not None else ((None, hard_case(n, world_size, k,
                                                                                                    seed)),)
    rows = {x[i].numpy().tobytes(): i for i in range(n)}
    calls = []
    for _, labels in draws:
        model = Classifier(seed).to(dev)
        dataset = TensorDataset(x.clone(), torch.tensor(labels))
        _seen.clear()
        torch.manual_seed(4242 + seed)  # every run and call alike, so a split drawn at random is the same in each
        random.seed(4242 + seed)
        numpy.random.seed(4242 + seed)
        returned = hardest(model, dataset, rank, world_size, functools.partial(sample_losses, batch_size=batch_size), k)
        seen = [rows.get(row.numpy().tobytes(), -1) for batch in _seen for row in batch]
        calls.append({"hardest": _indices(returned), "seen": seen})
    if shares is None:
        return calls[0]
    return {"calls": calls, "mine": tuple(mine for mine, _ in draws)}


def valid(got, losses: list[float], k: int) -> bool:
    """Whether ``got`` is k distinct dataset indices in order of loss, none of them below a loss left out."""
    if isinstance(got, str) or len(got) != k or len(set(got)) != k or not all(0 <= i < len(losses) for i in got):
        return False
    if any(losses[a] < losses[b] - TOLERANCE for a, b in zip(got, got[1:])):
        return False
    rest = [losses[i] for i in range(len(losses)) if i not in set(got)]
    return not rest or min(losses[i] for i in got) >= max(rest) - TOLERANCE


def _show(indices, losses) -> str:
    return "[" + ", ".join(f"{i} ({losses[i]:.3f})" if isinstance(i, int) and 0 <= i < len(losses) else str(i)
                           for i in indices) + "]"


def _judge_shares(check, obs, n, world_size, where) -> None:
    """Each sample through the model on exactly one rank, at most ceil(n / world_size) on a rank."""
    share = math.ceil(n / world_size)
    strangers = [r for r, o in enumerate(obs) if -1 in o["seen"]]
    if strangers:
        raise CheckFailed(check, f"the model was given inputs that are not samples of the dataset ({where})",
                          ranks=strangers, expected="each x exactly as the dataset holds it (moved to the device)",
                          hint="compute the losses with the given sample_losses(model, samples), samples a part of the "
                          "dataset: it gives the model each x as the dataset holds it")
    counts = [len(set(o["seen"])) for o in obs]  # samples, not forwards: a share evaluated twice is still the share
    over = [r for r, c in enumerate(counts) if c > share]
    if over:
        everything = all(set(obs[r]["seen"]) == set(range(n)) for r in over)
        seen = [i for o in obs for i in set(o["seen"])]
        uneven = len(seen) == len(set(seen)) == n  # each sample once: the shares are only unbalanced
        raise CheckFailed(check, f"{checks.rank_list(over)} evaluated more than one rank's share of the data ({where})",
                          ranks=over, expected=f"at most {share} samples per rank (ceil({n}/{world_size}))",
                          got=f"samples evaluated per rank: {counts}",
                          hint=("every rank evaluated the whole dataset: each rank computes the losses of its own part "
                                "only, and the ranks exchange what the others need" if everything else
                                f"balance the shares: {n} samples over {world_size} ranks leave at most {share} to a rank"
                                if uneven else "evaluate each sample on one rank only"))
    owners: dict[int, list[int]] = {}
    for r, o in enumerate(obs):
        for i in sorted(set(o["seen"])):
            owners.setdefault(i, []).append(r)
    twice = {i: rs for i, rs in owners.items() if len(rs) > 1}
    if twice:
        i, rs = next(iter(twice.items()))
        raise CheckFailed(check, f"{len(twice)} sample(s) went through the model on more than one rank ({where})",
                          ranks=sorted({r for rs in twice.values() for r in rs}),
                          expected="each sample evaluated on exactly one rank",
                          got=f"sample {i} on {checks.rank_list(rs)}; samples per rank: {counts}",
                          hint="a split that pads (DistributedSampler repeats samples so that every rank has as many) "
                          "evaluates some samples twice; take a split that gives each sample to one rank")
    missing = sorted(set(range(n)) - set(owners))
    if missing:
        raise CheckFailed(check, f"{len(missing)} sample(s) were evaluated on no rank ({where})",
                          ranks=range(world_size), expected=f"all {n} samples, each on one rank",
                          got=f"samples {missing[:10]} never reached the model; samples per rank: {counts}",
                          hint="split all the samples over the ranks: every rank takes its own share, and the shares "
                          "together are the dataset")


def _hint(got, share: list[int], losses: list[float], k: int, world_size: int, agreed: bool = False) -> str:
    """What one rank's wrong list says went wrong, judged from the samples it evaluated (``share``); ``agreed``: every
    rank returned this same list (so the ranks' candidates did meet)."""
    n = len(losses)
    want = top(losses, k)
    mine = sorted(set(share), key=lambda i: -losses[i])
    if isinstance(got, str):
        return f"return the k dataset indices as a list of ints (or a 1-D integer tensor), not a {got[1:-1]}"
    # the true k hardest, each named by its position in its rank's share (for the usual splits)
    positions = [[next(s.index(i) for s in split if i in s) for i in want]
                 for split in _splits(n, world_size).values()]
    positions.append([share.index(i) for i in mine[:k]])  # this rank's own hardest, by position in its share
    if got != want and got in positions:
        return ("these are positions within a rank's share, not indices of the dataset: position j of a Subset is "
                "the j-th index the share was made of; return the dataset's indices")
    if len(got) != len(set(got)):
        return "an index appears twice: each sample may be one of the k hardest once"
    if not agreed and (got == mine[:k] or (len(got) < k and got == mine)):
        return ("this rank returned the hardest samples of its own share only: every rank's candidates must reach "
                "every rank (a collective that gathers), and the k hardest are chosen from all of them")
    if len(got) != k:
        return (f"the list holds {len(got)} indices, not k = {k}: every rank offers its hardest min(k, its share) "
                "candidates, so that k remain once they all meet, and k of them are returned")
    if (agreed or set(got) - set(share)) and set(got) != set(want) and all(0 <= i < n for i in got):
        return ("the other ranks' candidates arrived, but the k returned are not the k of highest loss among all of "
                "them: rank every candidate of every rank together, by loss, highest first")
    if not all(0 <= i < n for i in got):
        return f"return indices of the dataset, 0 to {n - 1}"
    if set(got) == set(want):
        if got == want[::-1]:
            return "the right samples, ordered from the easiest: the hardest (highest loss) comes first"
        return "the right samples, in another order: sort them by loss, the highest first"
    return ("rank the losses of every rank's share together: each rank's k hardest candidates (with their dataset "
            "indices) from every rank, then the k highest of them all")


def check_hardest(hardest, *, world_size=3, n=11, k=4, batch_size=2, seed=0):
    """hardest() returns, on every rank, the dataset indices of the k samples of highest loss, the highest first, and
    each rank's model evaluated at most its share, ceil(n / world_size) samples, the ranks together all of them;
    called again on the same inputs with labels each rank draws for its own share alone (its copy of the rest
    labelled with their worst class), every rank evaluates the same share and returns each call's list."""
    check = "check_hardest"
    checks.require_written(check, hardest=hardest)
    where = f"the {k} hardest of {n} samples on {world_size} ranks"
    hints = [("invalid tensor size", "a tensor collective takes one size on every rank, and its output must match "
                                     "(all_gather: a list of world_size tensors of the input's size; "
                                     "all_gather_into_tensor: one tensor world_size times as long): the ranks' shares "
                                     "(and their candidates) may differ in length; make them one size, or gather "
                                     "Python objects"),
             ("selected index k out of range", "a rank may hold fewer than k samples: it cannot offer k candidates of "
                                               "its own"),
             ("Tensors must be CUDA and dense", "under nccl collectives take GPU tensors only: create them on the "
                                                "model's device")]
    obs = checks.run(check, _hardest_harness, world_size, args=(hardest, n, k, batch_size, seed),
                     expected=f"hardest() returns a list of {k} dataset indices on every rank", hints=hints).values
    _judge_shares(check, obs, n, world_size, where)
    losses = losses_of(n, seed, hard_case(n, world_size, k, seed))
    want = top(losses, k)
    got = [o["hardest"] for o in obs]
    wrong = [r for r, g in enumerate(got) if not valid(g, losses, k)]
    if wrong:
        r = wrong[0]
        raise CheckFailed(check, f"hardest() did not return the {k} hardest samples of the whole dataset ({where})",
                          ranks=wrong, expected=f"{_show(want, losses)} on every rank (dataset index (its loss)), the "
                          "highest loss first", got="; ".join(f"rank {q}: {_show(g, losses) if not isinstance(g, str) else g}"
                                                              for q, g in enumerate(got)),
                          hint=_hint(got[r], sorted(set(obs[r]["seen"])), losses, k, world_size,
                                     agreed=all(g == got[0] for g in got)))
    shares = [sorted(set(o["seen"])) for o in obs]
    _second_run(check, hardest, world_size, n, k, batch_size, seed, shares, want, where, hints)
    passed(check)


def _second_run(check, hardest, world_size, n, k, batch_size, seed, shares, first, where, hints):
    """Call hardest again, SECOND_CALLS times on the same inputs, each time with labels every rank drew for its own
    share alone: each rank's share must be the same samples in every call, and every rank's list valid for the
    labels all the ranks drew (put together here, in the grader's process)."""
    again = checks.run(check, _hardest_harness, world_size, args=(hardest, n, k, batch_size, seed, shares),
                       expected=f"hardest() returns a list of {k} dataset indices on every rank", hints=hints).values
    for call in range(SECOND_CALLS):
        moved = [r for r, o in enumerate(again) if sorted(set(o["calls"][call]["seen"])) != shares[r]]
        if moved:
            r = moved[0]
            raise CheckFailed(check, f"the samples each rank evaluated changed when only the labels changed ({where})",
                              ranks=moved, expected="the same share on each rank in every run: a split chosen from "
                              "rank, world_size and len(dataset) only", got=f"rank {r} evaluated samples {shares[r]}, "
                              f"then {sorted(set(again[r]['calls'][call]['seen']))}",
                              hint="split the samples by their index, never by the data's labels or values: a grader "
                              "(or a colleague) who runs your code again on other labels expects the same split")
    for call in range(SECOND_CALLS):
        labels = dict(pair for o in again for pair in o["mine"][call])
        losses = losses_of(n, seed, [labels[i] for i in range(n)])
        got = [o["calls"][call]["hardest"] for o in again]
        wrong = [r for r, g in enumerate(got) if not valid(g, losses, k)]
        if not wrong:
            continue
        if all(got[r] == first for r in wrong):
            problem = f"hardest() returned the first run's list again, although the labels had changed ({where})"
            hint = ("compute the list on every call, from this call's model and dataset: do not return one kept from "
                    "an earlier call (a file, a global, a cache)")
        else:
            whose = "its" if len(wrong) == 1 else "their"
            problem = f"{checks.rank_list(wrong)} ranked samples {whose} model did not evaluate ({where})"
            hint = ("rank this rank's own share with sample_losses(model, share), and take the other ranks' "
                    "candidates from the other ranks (a collective), not by evaluating their samples on this one or "
                    "by working out their labels")
        raise CheckFailed(check, problem, ranks=wrong,
                          expected=f"{_show(top(losses, k), losses)} on every rank (call {call + 1} of {SECOND_CALLS}: "
                          "each rank's share labelled by that rank alone, its copy of the other samples labelled "
                          "otherwise)", got="; ".join(f"rank {q}: {_show(g, losses) if not isinstance(g, str) else g}"
                                                       for q, g in enumerate(got)), hint=hint)
