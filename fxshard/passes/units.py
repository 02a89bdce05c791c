"""Which parameters move together: forming the units (see [Note: units and
flat shards] in fxshard/runtime/units.py for how a unit moves)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from fxshard.runtime.plans import Param


def form_units(
    params: Mapping[str, Param],
    first_use: Sequence[str],
    unit_bytes: int,
    explicit: Sequence[Sequence[str]] = (),
    blocks: Sequence[Sequence[str]] = (),
) -> list[list[list[Param]]]:
    """The units of the parameters in ``params`` (by name), from the order
    in which a graph first reads them, each as its reduce groups: the
    parameters of a unit, split where a backward may reduce them apart.

    ``explicit``, the user's groups, come first, each one unit (split where
    dtypes differ), members in first-use order; then ``blocks``, the weights
    of each outlined block (see [Note: outlined blocks]), less what the user
    listed: a block's call needs all of them at once, so a block is never
    split, and consecutive blocks join into units of about ``unit_bytes``.
    The rest, in first-use order, fill units of about ``unit_bytes`` of
    gathered weights, each within a run of first uses that no unit above
    interrupts: an embedding read first and an output projection read last
    are two units, not one held gathered through every block between them.
    A unit holds one dtype combination. Parameters the graph never reads
    get no unit. Units are in first-use order.

    A unit reduces in groups of at least a quarter of ``unit_bytes``: a
    unit of blocks its consecutive blocks (a group per block where blocks
    are that large), the rest's units their consecutive parameters in
    first-use order; the user's units in one group (see [Note: a reduce per
    block]).
    """
    order = {name: i for i, name in enumerate(first_use)}
    listed: set[str] = set()

    def take(group: Sequence[str]) -> list[list[Param]]:
        """``group``'s members not taken yet, in first-use order, by dtype."""
        members = sorted((n for n in group if n in order and n not in listed), key=order.__getitem__)
        listed.update(group)
        return _split_by_dtype([params[n] for n in members])

    units = [[infos] for group in explicit for infos in take(group)]
    whole = [infos for group in blocks for infos in take(group)]  # each block's weights, by dtype
    units.extend(_reduce_groups(unit, unit_bytes // 4)
                 for unit in _fill(sorted(whole, key=lambda g: order[g[0].fqn]), unit_bytes))  # fmt: skip
    for run in _runs([n for n in dict.fromkeys(first_use) if n in params], listed):
        units.extend(_reduce_groups(unit, unit_bytes // 4) for unit in _fill([[params[n]] for n in run], unit_bytes))
    units.sort(key=lambda unit: order[unit[0][0].fqn])
    return units


def _runs(first_use: Sequence[str], listed: set[str]) -> list[list[str]]:
    """The names of ``first_use`` not in ``listed``, split where a listed
    name comes between two of them."""
    runs: list[list[str]] = [[]]
    for name in first_use:
        if name not in listed:
            runs[-1].append(name)
        elif runs[-1]:
            runs.append([])
    return [run for run in runs if run]


def _gathered_bytes(infos: Sequence[Param]) -> int:
    # A tensor-parallel piece counts as its share of the global size, not
    # its own, which uneven TP pieces make differ: every TP rank then forms
    # the same units, and fxshard's gathers and TP's collectives come in one
    # order on each (see [Note: tensor-parallel parameters]).
    return sum((math.prod(i.shape) if i.plan.tp is None else -(-math.prod(i.plan.tp.shape) // i.plan.tp.size))
               * i.gather_dtype.itemsize for i in infos)  # fmt: skip


def _fill(blocks: list[list[Param]], unit_bytes: int) -> list[list[list[Param]]]:
    """Consecutive blocks (each never split; a lone parameter is a block of
    one) joined into units of about ``unit_bytes``, each unit as its blocks:
    a unit is closed once it holds ``unit_bytes`` or the next block's dtypes
    differ."""
    units: list[list[list[Param]]] = []
    for block in blocks:
        last = units[-1] if units else None
        if last and sum(map(_gathered_bytes, last)) < unit_bytes and _dtype_key(last[0][0]) == _dtype_key(block[0]):
            last.append(list(block))
        else:
            units.append([list(block)])
    return units


def _reduce_groups(blocks: list[list[Param]], least_bytes: int) -> list[list[Param]]:
    """A unit's consecutive ``blocks`` joined into reduce groups, each closed
    once it holds ``least_bytes`` of gathered weights; the last keeps what
    is left."""
    groups: list[list[Param]] = []
    for block in blocks:
        if groups and _gathered_bytes(groups[-1]) < least_bytes:
            groups[-1].extend(block)
        else:
            groups.append(list(block))
    return groups


def _dtype_key(info: Param) -> tuple:
    return (info.shard_dtype, info.gather_dtype, info.reduce_dtype, info.device)


def _split_by_dtype(infos: list[Param]) -> list[list[Param]]:
    groups: dict[tuple, list[Param]] = {}
    for info in infos:
        groups.setdefault(_dtype_key(info), []).append(info)
    return list(groups.values())
