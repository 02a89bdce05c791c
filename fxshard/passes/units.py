"""Which parameters move together: forming the units (see [Note: units and
flat shards] in fxshard/runtime/units.py for how a unit moves)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from fxshard.runtime.plans import Param

DEFAULT_UNIT_BYTES = 256 * 2**20
MODEL_SHARE = 8  # by default a unit holds at most this share of the model's gathered weights...
LEAST_LIMIT = DEFAULT_UNIT_BYTES // 4  # ...unless less than this, a reduce group's least by default


def unit_limit(params: Mapping[str, Param], unit_bytes: int | None) -> int:
    """The most gathered bytes a unit holds (a block larger than that is a
    unit alone): ``unit_bytes`` where the user gave it; by default 256 MiB,
    and at most an eighth of the model's gathered weights where that is
    more than 64 MiB.

    Two units are gathered at a time (the one computing and the one
    prefetched) where FSDP2 holds two layers. Units of 256 MiB held most of
    a small model: torchtitan's Qwen3 ``debugmodel_moe`` (8 layers of 75 MiB)
    made two units of four layers, and at 4 ranks its peak was 1.11x FSDP2 +
    compile's (1.02x with a unit per layer). An eighth bounds what two
    units hold to a quarter of the model and, where layers are large against
    that, to two layers, as under FSDP2. Below 64 MiB (the least a reduce
    group holds) a unit saves little memory and each more unit costs the
    host a gather and its wait per call: a unit per layer of DeepSeek-V3's
    ``debugmodel`` (10 MiB layers) saved 0.04 GiB and took about 4 ms more
    of a 50 ms step on 4 x H200.
    """
    if unit_bytes is not None:
        return unit_bytes
    share = sum(_gathered_bytes([p]) for p in params.values()) // MODEL_SHARE
    return min(DEFAULT_UNIT_BYTES, max(LEAST_LIMIT, share))


def form_units(
    params: Mapping[str, Param],
    first_use: Sequence[str],
    unit_bytes: int | None,
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
    split, and consecutive blocks join into units of at most
    ``unit_limit`` bytes of gathered weights (a larger block alone). The
    rest, in first-use order, fill units of the same size, each within a run of first uses that no unit above
    interrupts: an embedding read first and an output projection read last
    are two units, not one held gathered through every block between them.
    A unit holds one dtype combination. Parameters the graph never reads
    get no unit. Units are in first-use order.

    A unit reduces in groups of at least a quarter of ``unit_bytes`` (of
    256 MiB by default, whatever the limit: each reduce costs the host): a
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

    most, least = unit_limit(params, unit_bytes), LEAST_LIMIT if unit_bytes is None else unit_bytes // 4
    units = [[infos] for group in explicit for infos in take(group)]
    whole = [infos for group in blocks for infos in take(group)]  # each block's weights, by dtype
    units.extend(_reduce_groups(unit, least) for unit in _fill(sorted(whole, key=lambda g: order[g[0].fqn]), most))
    for run in _runs([n for n in dict.fromkeys(first_use) if n in params], listed):
        units.extend(_reduce_groups(unit, least) for unit in _fill([[params[n]] for n in run], most))
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


def _fill(blocks: list[list[Param]], most: int) -> list[list[list[Param]]]:
    """Consecutive blocks (each never split; a lone parameter is a block of
    one) joined into units of at most ``most`` bytes, each unit as its
    blocks: a block joins the last unit where both fit in ``most`` and
    their dtypes agree, else starts one (alone where it is larger)."""
    units: list[list[list[Param]]] = []
    for block in blocks:
        last = units[-1] if units else None
        if (last and _dtype_key(last[0][0]) == _dtype_key(block[0])
                and sum(map(_gathered_bytes, [*last, block])) <= most):  # fmt: skip
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
