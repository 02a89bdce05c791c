"""Ranks agree on their collectives before they issue them.

[Note: ranks agree on each graph]
In a model captured as one graph, each compiled graph holds its collectives
(see [Note: two ways to read]). Ranks can compile different graphs: code
that branches on input shapes (``if x.shape[1] > 8: x = self.a(x)``) with
other shapes on each rank, or another model on one rank. Their collectives
would then pair the wrong buffers (wrong numbers) or sizes (gloo aborts,
NCCL hangs).

So each graph gets a *signature*: the ordered list of what its collectives
depend on, one line per collective marker of the captured graph (parameter,
full shape, gather and reduce dtypes, whether its gradient is reduced; see
``passes/signature.py``), plus the units. The compiled forward, backward and
inference graphs are a deterministic function of the captured graph and
these, so one signature covers them all, including a backward that is
compiled later. Before a graph first runs on a rank, ``GraphAgreement.check``
compares its signature with the other ranks' through the default group's
store (a host-side channel: nothing on the device stream, no process group
of its own):

- the rank writes ``sig/<hash>/<rank>`` ("I run graphs with these
  collectives") and ``ord/<n>/<rank>`` (its n-th distinct signature, with
  the lines);
- it waits until every other rank has written ``sig/<hash>`` too. A rank
  whose n-th distinct signature is another one compiled a different graph at
  the same point: every rank raises ``RankMismatchError`` naming both graphs
  and the first collective that differs, before any of them runs.

After that the graph runs with no check: the cost is a few store round
trips once per graph, none per step. A graph whose signature a rank has
agreed on already (a recompile for new shapes with the same collectives)
does not wait, so a recompile on some ranks only is free. The check cannot
see a branch between graphs that every rank has already agreed on (after
warm-up, rank 0 takes the 'large' graph and rank 1 the 'small' one in the
same step); ``FXSHARD_CHECK_COLLECTIVES=1`` checks every collective as it is
issued, at the price of a CPU collective each.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist


class RankMismatchError(RuntimeError):
    """Ranks were about to issue collectives that do not match."""


def _first_difference(mine: Sequence[str], theirs: Sequence[str]) -> tuple[int, str, str]:
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else "(no collective)"
        b = theirs[i] if i < len(theirs) else "(no collective)"
        if a != b:
            return i, a, b
    return -1, "", ""


_HINT = ("Ranks compile different graphs when code branches on input shapes (`if x.shape[1] > 8:`) or on a "
         "Python value (the rank, an argument) that differs between ranks, or when the ranks' models differ: "
         "give every rank inputs that take the same branches, or make the branch independent of them")  # fmt: skip


class GraphAgreement:
    """One model's graph signatures, compared across ranks through a store."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, timeout_s: float = 900.0) -> None:
        self.store, self.prefix = store, prefix
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self._ordinal: dict[str, int] = {}  # this rank's distinct signatures, in first-run order
        self._agreed: set[str] = set()

    def check(self, graph: str, lines: Sequence[str]) -> None:
        """Return once every rank runs a graph with the collectives ``lines``;
        raise ``RankMismatchError`` on a rank that runs other ones."""
        sig = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:24]
        if sig in self._agreed:
            return
        n = self._ordinal.setdefault(sig, len(self._ordinal))
        self.store.set(f"{self.prefix}/sig/{sig}/{self.rank}", "1")
        self.store.set(f"{self.prefix}/ord/{n}/{self.rank}", "\n".join([sig, graph, *lines]))
        waiting = [r for r in range(self.world_size) if r != self.rank]
        deadline, pause = time.monotonic() + self.timeout_s, 0.002
        while waiting:
            waiting = [r for r in waiting if not self._agrees(r, sig, n, graph, lines)]
            if waiting and time.monotonic() > deadline:
                raise RankMismatchError(
                    f"fxshard: rank(s) {waiting} ran no graph with the collectives of {graph} on rank {self.rank} "
                    f"within {self.timeout_s:.0f} s (its first: {lines[0]}). They may be running another, "
                    f"older graph (a branch taken on some ranks only). {_HINT}"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
        self._agreed.add(sig)

    def _agrees(self, rank: int, sig: str, n: int, graph: str, lines: Sequence[str]) -> bool:
        if self.store.check([f"{self.prefix}/sig/{sig}/{rank}"]):
            return True
        key = f"{self.prefix}/ord/{n}/{rank}"
        if not self.store.check([key]):
            return False  # still compiling, or behind
        their_sig, their_graph, *theirs = self.store.get(key).decode().split("\n")
        if their_sig == sig or self.store.check([f"{self.prefix}/sig/{sig}/{rank}"]):
            return True
        i, a, b = _first_difference(lines, theirs)
        raise RankMismatchError(
            f"fxshard: ranks would issue different collectives: {graph} on rank {self.rank} and {their_graph} on "
            f"rank {rank} differ at collective {i}: rank {self.rank}: {a}; rank {rank}: {b}. {_HINT}"
        )


# [Note: checked collectives]
# With FXSHARD_CHECK_COLLECTIVES=1 (or TORCH_DISTRIBUTED_DEBUG=DETAIL),
# fxshard.compile registers a gloo group over the mesh's ranks here, for the
# gather and reduce groups, and every collective that fxshard issues from
# Python (gathers and reduces read outside compiled code, the units'
# collectives inside it) first all-gathers a hash of its description on
# that group. Ranks about to issue different collectives (a parameter read
# outside forward on one rank only) raise instead. Per-parameter
# collectives lowered into compiled graphs are covered by the graph check only.
_CHECK_GROUPS: dict[str, Any] = {}  # collective group name -> gloo group that checks it


def register_checked(group_names: Sequence[str], check_group: Any) -> None:
    for name in group_names:
        _CHECK_GROUPS[name] = check_group


def check_collective(group_name: str, describe: Callable[[], str]) -> None:
    """Before a collective on ``group_name``: raise ``RankMismatchError`` on
    every rank unless every rank is about to issue the collective that
    ``describe()`` names (see [Note: checked collectives]). Nothing, not even
    the description, unless the check is on for this group."""
    group = _CHECK_GROUPS.get(group_name)
    if group is None:
        return
    what = describe()
    digest = int.from_bytes(hashlib.sha256(what.encode()).digest()[:8], "little", signed=True)
    world_size = dist.get_world_size(group)
    hashes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    try:
        dist.all_gather(hashes, torch.tensor([digest], dtype=torch.int64), group=group)
    except RuntimeError as error:  # gloo: "Connection closed by peer", a timeout
        raise RankMismatchError(
            f"fxshard (FXSHARD_CHECK_COLLECTIVES): rank {dist.get_rank(group)} was about to issue {what}, and "
            "another rank never reached a collective to match it (it exited, destroyed its process group, or "
            "waits elsewhere). The ranks made different calls: a step skipped on some ranks, or a parameter "
            "read outside forward (`module.weight` is a collective) on some ranks only. Make the same calls "
            f"on every rank. The check's own error: {error}"
        ) from error
    if all(int(h) == digest for h in hashes):
        return
    whats: list = [None] * world_size
    dist.all_gather_object(whats, what, group=group)
    rank = dist.get_rank(group)
    listed = "; ".join(f"rank {r}: {w}" for r, w in enumerate(whats))
    raise RankMismatchError(
        f"fxshard (FXSHARD_CHECK_COLLECTIVES): rank {rank} was about to issue {what}, but the ranks differ: {listed}. "
        "Every rank must make the same parameter reads outside forward (reading `module.weight` is a collective): "
        "read on every rank, or read model.state_dict() / named_parameters() (the shards, no collective)"
    )
