"""Compile each repeated block once (see [Note: outlined blocks]).

[Note: outlined blocks]
A 32-layer model traces into one graph with 32 copies of the same block, and
AOTAutograd and Inductor then trace, partition, lower and generate code for
every copy: a first-step compile time that grows with depth.
``outline_blocks`` replaces each block's nodes in the captured graph by one
call of torch's ``invoke_subgraph`` higher-order op on a shared body, so
that AOTAutograd traces and partitions the body once and Inductor compiles
it once; the calls take the layer's gathered weights as inputs.

- A block is the nodes of one child of a module list (``layers.<i>``, from
  the nodes' ``nn_module_stack``), the unshard (and replicated read) markers excepted: those stay in
  the outer graph, where the unit passes gather, free and prefetch them as
  before, and the block takes the full weights as arguments.
- Blocks are outlined only where they are alike node for node: the same
  ops, the same constants, inputs of the same shapes, strides and dtypes. A
  block that differs gets a body of its own; one alike to none stays inline.
- A block must read weights. Outlining is proven on layers that do, and a
  block without weights (the activations of an ``nn.Sequential``) is too
  small for one compile instead of many to matter; it stays inline.
- Nodes outside a block that the graph interleaves with it (its unshards)
  move ahead of it; a block whose values are read before its end is left
  inline, as is one with effects torch cannot replay (in-place ops on
  inputs, batch norm's running statistics, RNG, vmap levels,
  ``get_attr``/``call_module`` nodes), or one interleaved with such an effect
  that would have to move.
- Modes (``_settle_modes``): dynamo records autocast regions, grad-mode
  changes and ``sdpa_kernel``'s backend choices with no module, between a
  layer's nodes (torchtitan's MoE: the router under autocast, a token count
  ``add_``-ed to a buffer under ``no_grad``, attention with cuDNN first). An
  autocast region or a backend choice that opens and closes within the layer
  joins the block, and the body replays it; a write to a buffer that the
  layer does not otherwise read moves after the call, with the grad-mode
  changes around it (read before, the buffer is an input that the call saves
  for its backward, and the moved write failed that backward). Neither may
  move ahead of the block: a backend choice moved there was undone before
  the body was traced, and torchtitan's layers ran flash attention instead
  of cuDNN's. A layer inside an autocast region opened outside it (by the
  model or by the caller) stays inline: torch traces the body's backward
  under the region where its call is, and eager's backward runs outside it.
  So does a layer inside an ``sdpa_kernel`` choice that the model makes
  around it: the body was traced without it. A block that makes or converts
  DTensors (tensor parallelism's hooks and reads, see [Note: tensor-parallel
  parameters]) stays inline too: torch cannot trace ``from_local``'s
  autograd function inside a body (it has no ``setup_context``).
- Saved weights: inside a body a weight is an input, which the body's
  partition saves for backward as an output of the forward call. The
  ``tag_unshard`` pass then routes the backward call to the outer unshard
  instead (see ``reroute_saved_weights``), which the policy recomputes, so
  the backward gathers again and the forward saves no full weight.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy

from fxshard.passes.dump import dotted_path
from fxshard.passes.markers import example_value, full_weight_views, is_sharded_read, is_weight_read, param_of
from fxshard.passes.runner import Recorded
from fxshard.passes.tagging import backward_nodes
from fxshard.runtime import compat

_INDEX = re.compile(r"^(?:(.*)\.)?(\d+)$")
_HOP = compat.invoke_subgraph_op()
_DTENSOR_METHODS = frozenset({"to_local", "redistribute", "full_tensor"})
# Functions that write their tensor arguments with no trailing "_" in their name: batch norm's running
# statistics. torch's invoke_subgraph cannot train a body that writes its inputs.
_WRITES_ARGS = frozenset({"batch_norm", "instance_norm", "native_batch_norm", "_native_batch_norm_legit",
                          "embedding_renorm_", "_batch_norm_impl_index", "cudnn_batch_norm", "miopen_batch_norm"})  # fmt: skip
_RANDOM = frozenset({"rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "bernoulli",
                     "normal", "multinomial", "uniform", "rrelu", "poisson"})  # fmt: skip


@dataclass
class OutlineRecord:
    """What ``outline_blocks`` did: blocks per body, and blocks left inline."""

    bodies: list[list[str]] = field(default_factory=list)  # per body: the blocks calling it
    inline: list[str] = field(default_factory=list)
    weights: list[list[str]] = field(default_factory=list)  # per outlined block: the parameters it reads
    why: dict[str, str] = field(default_factory=dict)  # per inline block: why it stays inline

    def format(self) -> str:
        if not self.bodies and not self.inline:
            return "outlined blocks: none\n"
        parts = [f"{len(b)} x body {i} ({b[0]}, ...)" if len(b) > 1 else f"body {i} ({b[0]})"
                 for i, b in enumerate(self.bodies)]  # fmt: skip
        line = "outlined blocks (each body compiled once): " + (", ".join(parts) or "none")
        if self.inline:  # with the reason: a user whose layers all stay inline must learn why
            line += "; inline: " + ", ".join(f"{n} ({self.why[n]})" if n in self.why else n for n in self.inline)
        return line + "\n"


def _block_of(node: fx.Node) -> tuple[str, int] | None:
    """The outermost ``(list path, index)`` in the node's module stack."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    for path, _cls in stack.values():
        match = _INDEX.match(dotted_path(str(path)))
        if match:
            return match.group(1) or "", int(match.group(2))
    return None


def _static(value: Any) -> bool:
    """Whether ``value`` (a node's example value) has only static sizes: a
    body takes no symbolic sizes from the outer graph."""
    if isinstance(value, torch.Tensor):
        return all(isinstance(d, int) for d in (*value.shape, *value.stride()))
    if isinstance(value, (list, tuple)):
        return all(_static(v) for v in value)
    return not isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool)


def _tensor_key(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), tuple(value.stride()), value.dtype, value.requires_grad, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_tensor_key(v) for v in value)
    return repr(type(value))


def _op_name(node: fx.Node) -> str:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return name.split(".")[0]  # an OpOverload's "randn.default"


def _in_place(name: str) -> bool:
    return name.endswith("_") and not name.startswith("_")


def _replayable(node: fx.Node) -> bool:
    """Whether a body may hold ``node``: a pure call of a function or method."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = _op_name(node)
    if _in_place(name) or name in _RANDOM or "dropout" in name or name in _WRITES_ARGS:
        return False  # in place, or random
    if str(node.target).startswith("fxshard."):  # an fxshard op (OpOverload or packet)
        return False  # a collective: the unit passes must see it
    module = getattr(node.target, "__module__", None) or ""
    if module.startswith("torch._functorch"):
        return False  # vmap levels and batch dims (dynamo inlines torch.vmap): tracer state, not data
    if module.startswith("torch.distributed") or name in _DTENSOR_METHODS:
        return False  # a DTensor's conversions (tensor parallelism): see the Note
    return not (compat.is_higher_order_op(node.target) or "autocast" in name or "grad" in name)


def _is_autocast(node: fx.Node) -> bool:
    return node.op == "call_function" and _op_name(node) in ("_enter_autocast", "_exit_autocast")


def _is_grad_mode(node: fx.Node) -> bool:
    return node.op == "call_function" and _op_name(node) == "_set_grad_enabled"


def _is_backend_choice(node: fx.Node) -> bool:
    """torch.nn.attention's ``sdpa_kernel`` (torchtitan's attention puts cuDNN
    first): it sets which kernel the SDPA traced after it uses."""
    return node.op == "call_function" and _op_name(node) in ("_sdpa_kernel", "_backend_from_string")


def _is_scoped(node: fx.Node) -> bool:
    """A node that sets a mode for the nodes traced after it, until a later one undoes it."""
    return _is_autocast(node) or _is_backend_choice(node)


def _scopes(nodes: list[fx.Node]) -> list[tuple[fx.Node, fx.Node]] | None:
    """Each autocast region and each backend choice among ``nodes``, as
    (opening, closing) nodes; None where one opens or closes elsewhere."""
    if not _autocast_balanced(nodes):
        return None
    scopes = [(e.args[0], e) for e in nodes if _is_autocast(e) and _op_name(e) == "_exit_autocast"]
    choices = [n for n in nodes if n.op == "call_function" and _op_name(n) == "_sdpa_kernel"]
    if len(choices) % 2:
        return None
    return scopes + list(zip(choices[::2], choices[1::2]))


def _autocast_balanced(nodes: list[fx.Node]) -> bool:
    """Every autocast region among ``nodes`` opens and closes among them:
    the body replays it whole, and the outer graph's mode is the same after
    the call as before."""
    enters = [n for n in nodes if _is_autocast(n) and _op_name(n) == "_enter_autocast"]
    exits = [n for n in nodes if _is_autocast(n) and _op_name(n) == "_exit_autocast"]
    return len(enters) == len(exits) and sorted(map(id, enters)) == sorted(id(e.args[0]) for e in exits)


@dataclass
class _Block:
    name: str
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    key: tuple


def _storage(node: fx.Node) -> Any:
    value = example_value(node)
    return StorageWeakRef(value.untyped_storage()) if isinstance(value, torch.Tensor) else None


def _writes_own_value(node: fx.Node, members: set[fx.Node], outside: set[Any]) -> bool:
    """An in-place op on a tensor the block made, that no block input shares
    memory with (Hugging Face's MoE clamps its expert ids in place): the body
    replays it on its own tensor, and AOTAutograd functionalizes it."""
    if node.op not in ("call_function", "call_method") or not _in_place(_op_name(node)):
        return False
    if _op_name(node) in _RANDOM or "dropout" in _op_name(node):
        return False
    target = node.args[0] if node.args else None
    if target not in members:
        return False
    storage = _storage(target)
    return storage is not None and storage not in outside and _replayable_args(node)


def _replayable_args(node: fx.Node) -> bool:
    """The op's other arguments are plain values or nodes (no effects of their own to check)."""
    return not (compat.is_higher_order_op(node.target) or str(node.target).startswith("fxshard."))


def _make_block(name: str, nodes: list[fx.Node]) -> _Block | str:
    """The block of ``nodes``, or why they cannot be one."""
    members = set(nodes)
    local = {n: i for i, n in enumerate(nodes)}
    inputs: dict[fx.Node, int] = {}
    ops = []
    outside = {_storage(a) for n in nodes for a in n.all_input_nodes if a not in members} - {None}
    if _scopes(nodes) is None:
        return "a mode set or undone outside the block"
    for node in nodes:
        if not (_replayable(node) or _writes_own_value(node, members, outside) or _is_scoped(node)):
            return f"{_op_name(node)}: an effect a body cannot replay"
        if not _static(example_value(node)):
            return f"{_op_name(node)}: symbolic sizes"

        def ref(arg: fx.Node) -> Any:
            if arg in members:
                return ("local", local[arg])
            return ("in", inputs.setdefault(arg, len(inputs)))

        args = fx.node.map_arg((node.args, node.kwargs), ref)
        ops.append((node.op, node.target, repr(args)))
    outputs = [n for n in nodes if any(u not in members for u in n.users)]
    if not outputs:
        return "no output"
    if not all(_static(example_value(i)) for i in inputs):
        return "an input of symbolic sizes"
    if not any(is_weight_read(i) for i in inputs):
        return "reads no weights"  # nothing to compile once that is worth a call (see the Note)
    key = (tuple(ops), tuple(_tensor_key(example_value(i)) for i in inputs),
           tuple(_tensor_key(example_value(n)) for n in nodes), tuple(local[o] for o in outputs))  # fmt: skip
    return _Block(name, nodes, list(inputs), outputs, key)


def _movable(node: fx.Node) -> bool:
    """Whether ``node`` may move ahead of a block: it computes a value from
    its inputs and nothing else (an unshard, a view or cast of a weight).
    Effects keep their place: vmap levels and grad mode (dynamo records no
    module for the node that closes a vmap), RNG, in-place ops."""
    if is_weight_read(node) or node.op == "get_attr":
        return True
    if _is_scoped(node) or example_value(node) is None:
        return False  # sets a mode (an SDPA backend choice once moved out of its layer), or has no value
    return _replayable(node) and not node.is_impure()


def _settle_modes(graph: fx.Graph, block: list[fx.Node]) -> str | None:
    """Prepare a block that runs part of its code in another mode.
    torchtitan's MoE computes its router's gate under
    ``torch.autocast(dtype=float32)``, its attention under ``sdpa_kernel``
    (cuDNN first), and adds its token counts to a buffer under
    ``torch.no_grad()``; dynamo records the mode changes with no module, so
    they are not the block's nodes, and ``_contiguous`` would refuse the
    block for them, or move a backend choice ahead of it:

    - an autocast region or a backend choice that opens and closes within
      the block (or just around its ends) joins it, and the body replays it,
      where the block's region holds nothing else but weight reads (which
      move ahead of the block, out of the region: modes do not touch them);
    - an in-place write to storage the block does not own (a buffer), whose
      result nothing reads, moves after the block's last node, with the
      grad-mode changes that enclose only such writes, where nothing else in
      the block and nothing after it in the span reads that storage and the
      mode after the block is the mode those changes restore: the body then
      writes none of its inputs, and the write stores the same values,
      later.

    Otherwise nothing moves, and it says why the block stays inline."""
    members = set(block)
    order = {n: i for i, n in enumerate(graph.nodes)}
    head, tail = _mode_span(block)
    earlier = _before(head)
    if _under_autocast(earlier):
        # torch traces a body's backward where it traces the call, under the region: eager's
        # backward runs outside it (an attention's gradients rounded otherwise, 1e-3 relative)
        return "runs under an autocast region opened outside it"
    if _choice_open(earlier):
        # a choice the body would not see: torch traced it with the default backends
        return "runs under an sdpa_kernel choice made outside it"
    span = _between(head, tail)
    outside = {_storage(a) for n in block for a in n.all_input_nodes if a not in members} - {None}

    def deferrable(node: fx.Node) -> bool:
        name = _op_name(node)
        if node not in members or node.users or not _in_place(name) or name in _RANDOM or "dropout" in name:
            return False
        target = node.args[0] if node.args else None
        return isinstance(target, fx.Node) and _storage(target) in outside and _replayable_args(node)

    modes = [n for n in span if _is_grad_mode(n)]
    moved = [n for n in span if deferrable(n)]
    if modes:  # every change must enclose writes only, in pairs whose second restores the mode before the first
        pairs = list(zip(modes[::2], modes[1::2]))
        if len(modes) % 2 or any(_grad_mode_before(on) != off.args[0] for on, off in pairs):
            return "_set_grad_enabled: a grad-mode change that the block does not undo"
        stray = next((n for on, off in pairs for n in span[span.index(on) + 1 : span.index(off)] if n not in moved),
                     None)  # fmt: skip
        if stray is not None:
            return (
                f"_set_grad_enabled: a grad-mode change around more than writes to buffers ({_op_name(stray)}); "
                "to compile the layer once, compute the values before torch.no_grad() and write each buffer with "
                "one in-place op whose result is not used (buf.lerp_(value, weight) for an average)"
            )
        moved = sorted([*moved, *modes], key=order.__getitem__)
    kept = [n for n in block if n not in moved]
    for node in moved:
        if node in members:
            storage = _storage(node.args[0])
            if _reads([n for n in span[span.index(node) + 1 :] if n not in moved], storage):
                return f"{_op_name(node)}: writes an input in place, and reads it after"
            # The call saves the body's inputs for its backward: a write after it changes a saved one,
            # and autograd refuses the backward (modified by an inplace operation).
            if _reads(kept, storage):
                return f"{_op_name(node)}: writes an input in place that the layer also reads"
    regions = [n for n in span if _is_scoped(n)]
    if regions:
        scopes = _scopes(regions)
        if scopes is None:
            return f"{_op_name(regions[0])}: a mode set or undone outside the block"
        where = {n: i for i, n in enumerate(span)}
        for opening, closing in scopes:
            inside = span[where[opening] + 1 : where[closing]]
            stray = next((n for n in inside if n not in members and not _is_scoped(n) and not _weight_read(n)), None)
            if stray is not None:  # it would move ahead of the block, out of the mode
                return f"{_op_name(stray)}: code of no block under the block's {_op_name(opening)}"
    if not kept or len(kept) == len(block) and not regions:
        return None
    anchor = next(n for n in reversed(span) if n not in moved)  # after every node they followed
    for node in reversed(moved):
        anchor.append(node)
    kept = set(kept)
    block[:] = [n for n in span if n in kept or _is_scoped(n)]
    return None


def _reads(nodes: list[fx.Node], storage: Any) -> bool:
    """Whether any of ``nodes`` takes an input in ``storage``."""
    found = (_storage(a) for n in nodes for a in n.all_input_nodes)
    return any(s is not None and s == storage for s in found)


def _mode_span(block: list[fx.Node]) -> tuple[fx.Node, fx.Node]:
    """The first and last node of ``block`` with the mode changes around its
    ends that close or open one within it: past its last node, autocast
    exits of regions opened within and backend choices while one is open
    (torchtitan's attention ends in ``sdpa_kernel``'s restore); before its
    first, past its weight reads, the matching enters and choices. A
    neighbour's own changes stay out."""
    members = set(block)
    head, tail = block[0], block[-1]

    def choice_open() -> bool:
        return _choice_open(_between(head, tail))

    while True:
        after = tail.next
        closes = _is_autocast(after) and _op_name(after) == "_exit_autocast" and after.args[0] in _between(head, tail)
        if not (closes or _is_backend_choice(after) and choice_open()):
            break
        tail = after
    probe = head
    while True:
        before = probe.prev
        if before.op == "root" or before in members:
            break
        inside = set(_between(head, tail))
        opens = _is_autocast(before) and _op_name(before) == "_enter_autocast" and not before.users.keys() - inside
        if opens or _is_backend_choice(before) and choice_open():
            head = probe = before
        elif _weight_read(before):
            probe = before
        else:
            break
    return head, tail


def _choice_open(nodes: list[fx.Node]) -> bool:
    """An odd number of backend choices among ``nodes``: one made and not undone."""
    return sum(_is_backend_choice(n) and _op_name(n) == "_sdpa_kernel" for n in nodes) % 2 == 1


def _under_autocast(earlier: list[fx.Node]) -> bool:
    """Whether the node after ``earlier`` (the graph's nodes before it) runs
    in an enabled autocast region: one they opened and did not close, or the
    caller's around the call."""
    if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        return True
    open_regions: set[fx.Node] = set()
    for before in earlier:
        if _is_autocast(before):
            if _op_name(before) == "_enter_autocast":
                open_regions.add(before)
            else:
                open_regions.discard(before.args[0])
    return any(enter.args[2] for enter in open_regions)  # _enter_autocast(device, dtype, enabled, cache)


def _before(node: fx.Node) -> list[fx.Node]:
    nodes = []
    for before in node.graph.nodes:
        if before is node:
            break
        nodes.append(before)
    return nodes


def _between(first: fx.Node, last: fx.Node) -> list[fx.Node]:
    nodes, node = [first], first
    while node is not last:
        node = node.next
        nodes.append(node)
    return nodes


def _weight_read(node: fx.Node) -> bool:
    return is_weight_read(node) or node.op == "get_attr"


def _grad_mode_before(node: fx.Node) -> bool:
    """The grad mode in which ``node`` runs: the last change before it, or
    the mode dynamo traced under (the backend runs in it)."""
    prev = node.prev
    while prev.op != "root":
        if _is_grad_mode(prev):
            return bool(prev.args[0])
        prev = prev.prev
    return torch.is_grad_enabled()


def _contiguous(graph: fx.Graph, block: list[fx.Node]) -> str | None:
    """Move the nodes interleaved with ``block`` ahead of it; or, moving
    nothing, why not: one of them reads the block (the block's values are
    needed before its end) or must keep its place (see ``_movable``)."""
    members = set(block)
    order = {n: i for i, n in enumerate(graph.nodes)}
    first, last = order[block[0]], order[block[-1]]
    between = [n for n in graph.nodes if first < order[n] < last and n not in members]
    if any(a in members for n in between for a in n.all_input_nodes):
        return "its values are read before its end"
    fixed = next((n for n in between if not _movable(n)), None)
    if fixed is not None:
        return f"{_op_name(fixed)}: an effect among its nodes"
    for node in between:
        block[0].prepend(node)
    return None


def _body(gm: fx.GraphModule, block: _Block) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, arg in enumerate(block.inputs):
        env[arg] = graph.placeholder(f"arg{i}")
        env[arg].meta = {k: v for k, v in arg.meta.items() if k in ("example_value", "val", "tensor_meta")}
    for node in block.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[o] for o in block.outputs))
    return fx.GraphModule(gm, graph)


def outline_blocks_pass(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Recorded:
    """Replace alike blocks by ``invoke_subgraph`` calls of one body each;
    the record is an ``OutlineRecord``."""
    graph = gm.graph
    if _HOP is None:
        return Recorded(gm, OutlineRecord())
    by_list: dict[str, dict[int, list[fx.Node]]] = {}
    for node in graph.nodes:
        if node.op == "placeholder" or node.op == "output" or is_weight_read(node):
            continue
        where = _block_of(node)
        if where is not None:
            by_list.setdefault(where[0], {}).setdefault(where[1], []).append(node)
    classes: dict[tuple, list[_Block]] = {}
    inline: list[str] = []
    why: dict[str, str] = {}
    for prefix, blocks_by_index in by_list.items():
        if len(blocks_by_index) < 2:
            continue
        for index, nodes in sorted(blocks_by_index.items()):
            name = f"{prefix}.{index}" if prefix else str(index)
            block = _settle_modes(graph, nodes) or _contiguous(graph, nodes) or _make_block(name, nodes)
            if isinstance(block, str):
                inline.append(name)
                why[name] = block
            else:
                classes.setdefault(block.key, []).append(block)
    if not classes and not inline:
        return Recorded(gm, OutlineRecord())
    bodies: list[list[str]] = []
    outlined: list[tuple[_Block, str]] = []
    weights: list[list[str]] = []
    for members in classes.values():
        if len(members) < 2:
            inline.extend(b.name for b in members)
            why.update((b.name, "alike to no other block") for b in members)
            continue
        body_name = f"fxshard_block_{len(bodies)}"
        gm.register_module(body_name, _body(gm, members[0]))
        outlined.extend((block, body_name) for block in members)
        weights.extend([param_of(i).fqn for i in block.inputs if is_sharded_read(i)] for block in members)
        bodies.append([b.name for b in members])
    renamed: dict[fx.Node, fx.Node] = {}  # a replaced block's outputs -> their getitems
    resolved: dict[fx.Node, fx.Node] = {}  # an input with a lazy bit -> it resolved, once for every call
    order = {n: i for i, n in enumerate(graph.nodes)}
    for block, body_name in sorted(outlined, key=lambda bb: order[bb[0].nodes[0]]):
        block.inputs = [renamed.get(i, i) for i in block.inputs]
        renamed.update(_replace(graph, block, body_name, [_resolved(graph, i, resolved) for i in block.inputs]))
    graph.lint()
    gm.recompile()
    return Recorded(gm, OutlineRecord(bodies, sorted(inline), weights, why))


def _resolved(graph: fx.Graph, node: fx.Node, done: dict[fx.Node, fx.Node]) -> fx.Node:
    """``node``, or, where its value has a lazy conjugate or negative bit,
    its value resolved (``torch.resolve_conj``, ``torch.resolve_neg``) right
    after it: torch has no ``invoke_subgraph`` kernel for a tensor with
    either bit ("... at dispatch key Conjugate" / "Negative"). A body's
    inputs are placeholders, which see the value, not the bit, so the body
    is the same either way. What backward saves is resolved later
    (``resolve_call_inputs_pass``)."""
    value = example_value(node)
    if not isinstance(value, torch.Tensor) or not (value.is_conj() or value.is_neg()):
        return node
    if node not in done:
        with graph.inserting_after(node):
            conj = graph.call_function(torch.resolve_conj, (node,))
        with graph.inserting_after(conj):
            neg = graph.call_function(torch.resolve_neg, (conj,))
        conj.meta["example_value"] = value.resolve_conj()
        neg.meta["example_value"] = conj.meta["example_value"].resolve_neg()
        done[node] = neg
    return done[node]


def _replace(graph: fx.Graph, block: _Block, body_name: str, args: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Replace ``block`` by a call of ``body_name`` on ``args`` (its inputs,
    or values equal to them); returns its outputs' getitems."""
    with graph.inserting_after(block.nodes[-1]):
        body = graph.get_attr(body_name)
    with graph.inserting_after(body):
        call = graph.call_function(_HOP, (body, body_name, *args))
    call.meta["example_value"] = tuple(example_value(o) for o in block.outputs)
    members = set(block.nodes)
    items: dict[fx.Node, fx.Node] = {}
    last = call
    for i, out in enumerate(block.outputs):
        with graph.inserting_after(last):
            item = graph.call_function(operator.getitem, (call, i))
        item.meta = dict(out.meta)
        out.replace_all_uses_with(item, delete_user_cb=lambda user: user not in members)
        items[out] = last = item
    for node in reversed(block.nodes):
        graph.erase_node(node)
    return items


def reroute_saved_inputs_pass(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """In a joint graph whose bodies are partitioned: where a forward call
    returns one of its own inputs for the backward (a body saves the weights
    it read), read that input instead. A weight then reaches the backward
    from its unshard, which the reshard policy recomputes, not from the
    forward call, which the partitioner would have to save."""
    graph = gm.graph
    for call in list(graph.nodes):
        if call.target is not _HOP or call.args[0].op != "get_attr":
            continue
        body = getattr(gm, call.args[0].target)
        placeholders = {n: j for j, n in enumerate(n for n in body.graph.nodes if n.op == "placeholder")}
        (outputs,) = [n.args[0] for n in body.graph.nodes if n.op == "output"]
        for item in list(call.users):
            if item.target is not operator.getitem:
                continue
            out = outputs[item.args[1]]
            if isinstance(out, fx.Node) and out in placeholders:
                item.replace_all_uses_with(call.args[2 + placeholders[out]])
                graph.erase_node(item)
    return gm


def tag_body_inputs_pass(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """On a body's joint (one without unshards): recompute the views and
    casts of its inputs, so that its partition saves the inputs themselves,
    which ``reroute_saved_inputs`` hands to the outer graph's recomputed
    reads (unshards, or ZeRO-1's kept copies), rather than a transposed
    weight. Views cost nothing to recompute. The outer joint (it has the
    read markers) is left to ``tag_unshard``."""
    graph = gm.graph
    if any(is_weight_read(n) for n in graph.nodes):
        return gm
    in_backward = backward_nodes(graph)
    for node in graph.nodes:
        if node.op == "placeholder" and node not in in_backward:
            for view in full_weight_views(node, exclude=in_backward)[1:]:
                view.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return gm


def resolve_call_inputs_pass(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Give each body call (``invoke_subgraph``) its inputs without lazy
    conjugate or negative bits: ``resolve_conj`` and ``resolve_neg`` before
    every complex input, and before any input whose value has either bit.

    Autograd saves a complex weight's lazy conjugate for backward (Llama 3's
    RoPE: ``freqs_cis`` in ``x * freqs_cis``), and torch has no
    ``invoke_subgraph`` kernel for a tensor with the bit ("could not find
    kernel for HigherOrderOperator invoke_subgraph at dispatch key
    Conjugate"), under either compiler. On a tensor without the bit each
    resolve returns it as it is. Runs on the forward and backward graphs; a
    graph without calls is left alone."""
    graph, changed = gm.graph, False
    for call in list(graph.nodes):
        if call.target is not _HOP:
            continue
        args = list(call.args)
        for i, arg in enumerate(args[2:], start=2):
            value = arg.meta.get("val") if isinstance(arg, fx.Node) else None
            if not isinstance(value, torch.Tensor) or not _may_be_lazy(value):
                continue
            with graph.inserting_before(call):
                resolved = graph.call_function(torch.ops.aten.resolve_conj.default, (arg,))
                resolved = graph.call_function(torch.ops.aten.resolve_neg.default, (resolved,))
            resolved.meta["val"] = value.resolve_conj().resolve_neg() if value.is_conj() or value.is_neg() else value
            args[i], changed = resolved, True
        call.args = tuple(args)
    if changed:
        graph.lint()
        gm.recompile()
    return gm


def _may_be_lazy(value: torch.Tensor) -> bool:
    return value.is_complex() or value.is_conj() or value.is_neg()
