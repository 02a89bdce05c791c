"""A zoo of small random architectures, one per seed, for parity as a property.

``plan(seed)`` draws an architecture as plain data (a ``Plan``: a stem, a few
parts, a head); ``make_model(seed)`` builds it, ``make_batch(seed, gen)``
feeds it and ``scenario(seed, backend)`` turns it into a ``tests.parity``
``Scenario`` under fxshard's default options. ``run_seeds`` trains many seeds
inside one set of ranks, since starting processes and gloo costs seconds and
a tiny model compiles in about one.

The parts cover what fxshard must handle wherever it appears: parameter-less
modules between Linears in an ``nn.Sequential`` (alike children ``<i>``,
which ``compile_blocks_once`` outlines), repeated blocks in ``nn.ModuleList``
and ``nn.Sequential`` with and without parameters, ``nn.ModuleDict``,
nesting, a module called twice or registered twice, tied weights, buffers,
frozen parts, a parent calling ``F.linear`` / ``F.conv1d`` on its child's
weight, and dim 0 smaller than the world size (empty and uneven shards).
The architecture depends only on the seed; the weights come from the
harness's ``torch.manual_seed(0)``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxshard
from tests.helpers.parity import Scenario, train_and_compare

WIDTHS = (5, 6, 7, 9, 12, 16, 24, 33, 48)  # hidden sizes; most not divisible by 2 or 3
NARROW = (1, 2, 3)  # dim 0 below the world size: empty shards
ACTIVATIONS = {"relu": (nn.ReLU, F.relu), "gelu": (nn.GELU, F.gelu), "silu": (nn.SiLU, F.silu),
               "tanh": (nn.Tanh, torch.tanh)}  # fmt: skip
KINDS = ("mlp", "gated", "norm", "conv1d", "conv2d", "stack", "shared", "buffer", "direct", "narrow", "nested")
BLOCKS = ("prenorm_mlp", "act_only", "linear_act", "scaled_act")  # what a stack repeats


@dataclass(frozen=True)
class Part:
    """One part of the body: its kind and the choices drawn for it."""

    kind: str
    act: str  # activation name
    functional: bool  # activation as F.<act> rather than a module
    residual: bool  # x + part(x)
    frozen: bool  # requires_grad=False on its parameters
    size: int  # hidden width, kernel or repeat count, by kind
    variant: str  # a kind's sub-choice (container, norm, block, ...)
    inner: tuple[Part, ...] = ()  # nested parts

    def describe(self) -> str:
        flags = [self.variant] if self.variant else []
        if self.kind not in ("norm", "nested"):  # these use neither the activation nor the size
            flags += [f"F.{self.act}" if self.functional else self.act, f"n{self.size}"]
        flags += ["res"] * self.residual + ["frozen"] * self.frozen
        inner = f"[{', '.join(p.describe() for p in self.inner)}]" if self.inner else ""
        return f"{self.kind}({' '.join(f for f in flags if f)}){inner}"


@dataclass(frozen=True)
class Plan:
    """An architecture: token ids into an embedding (vocab > 0) or float
    features of width ``width_in``; ``parts`` at width ``width``; a head of
    ``out`` outputs, or the embedding's transpose when ``tied``."""

    seed: int
    vocab: int  # 0: float input
    width_in: int
    width: int
    seq: int
    parts: tuple[Part, ...]
    out: int
    tied: bool
    frozen_stem: bool
    direct_head: bool  # the root calls F.linear on the head's weight
    # Parts in a ModuleList (body.<i>) or as attributes part<i>. outline_blocks
    # takes the outermost indexed module as the block, so body.<i> hides the
    # indexed modules inside the parts (an nn.Sequential's children).
    listed: bool
    # The model is nn.Sequential(stem, act, part, act, part, ..., head), each
    # act the activation module drawn for the part after it: parameter-less
    # children between parts, which outline_blocks sees as alike blocks
    # <i> (tied and direct heads need ZooModel's forward).
    sequential_drawn: bool

    @property
    def sequential(self) -> bool:
        return self.sequential_drawn and not self.tied and not self.direct_head

    def describe(self) -> str:
        stem = f"embed({self.vocab},{self.width}" if self.vocab else f"linear({self.width_in},{self.width}"
        stem += ",frozen)" if self.frozen_stem else ")"
        head = "tied" if self.tied else f"{'F.linear' if self.direct_head else 'linear'}({self.width},{self.out})"
        body = " > ".join(p.describe() for p in self.parts)
        if self.sequential:
            body = " > ".join(f"{p.act} > {p.describe()}" for p in self.parts)
            return f"seed {self.seed}: Sequential[{stem} > {body} > {head}]"
        return f"seed {self.seed}: {stem} > {'body[' + body + ']' if self.listed else body} > {head}"


def _part(rng: random.Random, depth: int) -> Part:
    kind = rng.choice(KINDS if depth == 0 else KINDS[:-1])
    size = {"conv1d": rng.choice((1, 2, 3)), "conv2d": rng.choice((1, 2, 3)), "stack": rng.choice((2, 3)),
            "narrow": rng.choice(NARROW)}.get(kind, rng.choice(WIDTHS))  # fmt: skip
    variant = {
        "mlp": rng.choice(("2", "3")),  # Linear-act-Linear, or Linear-act-Linear-act-Linear
        "norm": rng.choice(("layernorm", "layernorm_nobias", "layernorm_noaffine", "rmsnorm", "rmsnorm_noaffine")),
        "conv1d": rng.choice(("module", "direct", "depthwise")),
        "stack": rng.choice(("modulelist", "sequential")) + ":" + rng.choice(BLOCKS),
        "shared": rng.choice(("twice", "registered_twice")),
        "buffer": rng.choice(("persistent", "nonpersistent")),
        "nested": rng.choice(("sequential", "modulelist", "moduledict")),
    }.get(kind, "")
    inner = tuple(_part(rng, depth + 1) for _ in range(rng.randint(1, 2))) if kind == "nested" else ()
    return Part(kind, rng.choice(tuple(ACTIVATIONS)), rng.random() < 0.5, rng.random() < 0.5,
                rng.random() < 0.15, size, variant, inner)  # fmt: skip


@functools.cache
def plan(seed: int) -> Plan:
    rng = random.Random(seed)
    vocab = rng.choice((0, 0, 2, 3, 5, 11, 37))
    width = rng.choice(WIDTHS)
    parts = tuple(_part(rng, 0) for _ in range(rng.randint(1, 4)))
    tied = bool(vocab) and rng.random() < 0.5
    return Plan(seed, vocab, rng.choice(WIDTHS), width, rng.choice((3, 4, 5, 7)), parts,
                rng.choice((*NARROW, 5, width)), tied, rng.random() < 0.1, rng.random() < 0.3,
                rng.random() < 0.5, rng.random() < 0.3)  # fmt: skip


class Act(nn.Module):
    """An activation as a module, or as a functional call inside a module."""

    def __init__(self, name: str, functional: bool) -> None:
        super().__init__()
        self.module = None if functional else ACTIVATIONS[name][0]()
        self.fn = ACTIVATIONS[name][1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x) if self.module is None else self.module(x)


def _act(p: Part) -> nn.Module:
    """In an ``nn.Sequential`` the activation is the module itself (no
    wrapper), the common pattern; ``functional`` wraps F.<act> in ``Act``."""
    return Act(p.act, True) if p.functional else ACTIVATIONS[p.act][0]()


def _norm(variant: str, width: int) -> nn.Module:
    if variant.startswith("rmsnorm"):
        return nn.RMSNorm(width, elementwise_affine=variant == "rmsnorm")
    return nn.LayerNorm(width, elementwise_affine=variant != "layernorm_noaffine", bias=variant == "layernorm")


class Mlp(nn.Module):
    def __init__(self, p: Part, width: int) -> None:
        super().__init__()
        layers = [nn.Linear(width, p.size), _act(p), nn.Linear(p.size, width)]
        if p.variant == "3":
            layers[2:2] = [nn.Linear(p.size, p.size), _act(p)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Gated(nn.Module):
    """SwiGLU-style, its projections in an ``nn.ModuleDict``."""

    def __init__(self, p: Part, width: int) -> None:
        super().__init__()
        self.proj = nn.ModuleDict({"up": nn.Linear(width, p.size, bias=False), "gate": nn.Linear(width, p.size),
                                   "down": nn.Linear(p.size, width)})  # fmt: skip
        self.act = Act(p.act, p.functional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj["down"](self.act(self.proj["gate"](x)) * self.proj["up"](x))


class Conv1dPart(nn.Module):
    """Over the sequence; ``direct``: the parent calls F.conv1d on the
    child's weight and bias, as fused Mamba kernels do."""

    def __init__(self, p: Part, width: int) -> None:
        super().__init__()
        kernel = 2 * p.size - 1  # odd: the padding keeps the length
        self.direct = p.variant == "direct"
        groups = width if p.variant == "depthwise" else 1
        self.conv = nn.Conv1d(width, width, kernel, padding=p.size - 1, groups=groups)
        self.act = Act(p.act, p.functional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)
        if self.direct:
            h = F.conv1d(h, self.conv.weight, self.conv.bias, padding=self.conv.padding)
        else:
            h = self.conv(h)
        return self.act(h.transpose(1, 2))


class Conv2dPart(nn.Module):
    """(batch, seq, width) as a one-channel image, ``size`` channels out, averaged back."""

    def __init__(self, p: Part, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, p.size, 3, padding=1)
        self.act = Act(p.act, p.functional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(x.unsqueeze(1))).mean(1)


class Block(nn.Module):
    """What a stack repeats: with parameters (``prenorm_mlp``,
    ``linear_act``) or without (``act_only``, ``scaled_act``)."""

    def __init__(self, kind: str, p: Part, width: int) -> None:
        super().__init__()
        self.kind = kind
        if kind == "prenorm_mlp":
            self.norm = nn.RMSNorm(width) if p.functional else nn.LayerNorm(width)
            self.mlp = nn.Sequential(nn.Linear(width, 2 * width), _act(p), nn.Linear(2 * width, width))
        elif kind == "linear_act":
            self.lin = nn.Linear(width, width)
        self.act = Act(p.act, p.functional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "prenorm_mlp":
            return x + self.mlp(self.norm(x))
        if self.kind == "linear_act":
            return self.act(self.lin(x))
        if self.kind == "scaled_act":
            return x + 0.5 * self.act(x)
        return self.act(x)


class Stack(nn.Module):
    """``size`` alike blocks in an ``nn.ModuleList`` (a loop) or an ``nn.Sequential``."""

    def __init__(self, p: Part, width: int) -> None:
        super().__init__()
        container, block = p.variant.split(":")
        blocks = [Block(block, p, width) for _ in range(p.size)]
        self.layers = nn.ModuleList(blocks) if container == "modulelist" else nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.layers, nn.Sequential):
            return self.layers(x)
        for layer in self.layers:
            x = layer(x)
        return x


class Shared(nn.Module):
    """One Linear applied twice: called twice through one name, or
    registered under two names (``first``, ``second``) and called once each."""

    def __init__(self, p: Part, width: int) -> None:
        super().__init__()
        self.first = nn.Linear(width, width)
        if p.variant == "registered_twice":
            self.second = self.first
        self.act = Act(p.act, p.functional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        second = getattr(self, "second", self.first)
        return second(self.act(self.first(x)))


class Scale(nn.Module):
    """A Linear followed by a registered scale buffer."""

    def __init__(self, p: Part, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width), persistent=p.variant == "persistent")
        self.act = Act(p.act, p.functional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x)) * self.scale


class Direct(nn.Module):
    """The parent reads ``self.proj.weight`` and calls F.linear itself;
    ``proj`` is never called."""

    def __init__(self, p: Part, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, p.size)
        self.back = nn.Linear(p.size, width, bias=False)
        self.act = Act(p.act, p.functional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.back(self.act(F.linear(x, self.proj.weight, self.proj.bias)))


class Narrow(nn.Module):
    """A bottleneck of 1 to 3 units: dim 0 (and the bias) below the world size."""

    def __init__(self, p: Part, width: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, p.size)
        self.up = nn.Linear(p.size, width)
        self.act = Act(p.act, p.functional)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.act(self.down(x)))


class Nested(nn.Module):
    """Parts inside an ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``."""

    def __init__(self, p: Part, width: int) -> None:
        super().__init__()
        parts = [build_part(q, width) for q in p.inner]
        if p.variant == "sequential":
            self.parts = nn.Sequential(*parts)
        elif p.variant == "modulelist":
            self.parts = nn.ModuleList(parts)
        else:
            self.parts = nn.ModuleDict({f"p{i}": part for i, part in enumerate(parts)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.parts, nn.Sequential):
            return self.parts(x)
        for part in self.parts.values() if isinstance(self.parts, nn.ModuleDict) else self.parts:
            x = part(x)
        return x


class Residual(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


PARTS = {"mlp": Mlp, "gated": Gated, "conv1d": Conv1dPart, "conv2d": Conv2dPart, "stack": Stack, "shared": Shared,
         "buffer": Scale, "direct": Direct, "narrow": Narrow, "nested": Nested}  # fmt: skip


def build_part(p: Part, width: int) -> nn.Module:
    module = _norm(p.variant, width) if p.kind == "norm" else PARTS[p.kind](p, width)
    if p.frozen:
        module.requires_grad_(False)
    return Residual(module) if p.residual else module


class ZooModel(nn.Module):
    def __init__(self, arch: Plan) -> None:
        super().__init__()
        self.arch = arch
        if arch.vocab:
            self.embed = nn.Embedding(arch.vocab, arch.width)
        else:
            self.stem = nn.Linear(arch.width_in, arch.width)
        (self.embed if arch.vocab else self.stem).requires_grad_(not arch.frozen_stem)
        parts = [build_part(p, arch.width) for p in arch.parts]
        if arch.listed:
            self.body = nn.ModuleList(parts)
        else:
            for i, part in enumerate(parts):
                self.add_module(f"part{i}", part)
        if not arch.tied:
            self.head = nn.Linear(arch.width, arch.out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.arch.vocab else self.stem(x)
        for i in range(len(self.arch.parts)):
            h = (self.body[i] if self.arch.listed else getattr(self, f"part{i}"))(h)
        if self.arch.tied:
            return F.linear(h, self.embed.weight)
        if self.arch.direct_head:
            return F.linear(h, self.head.weight, self.head.bias)
        return self.head(h)

    def extra_repr(self) -> str:
        return self.arch.describe()


def make_model(seed: int) -> nn.Module:
    arch = plan(seed)
    if not arch.sequential:
        model = ZooModel(arch)
    else:
        stem = nn.Embedding(arch.vocab, arch.width) if arch.vocab else nn.Linear(arch.width_in, arch.width)
        stem.requires_grad_(not arch.frozen_stem)
        parts = [m for p in arch.parts for m in (ACTIVATIONS[p.act][0](), build_part(p, arch.width))]
        model = nn.Sequential(stem, *parts, nn.Linear(arch.width, arch.out))
    if not any(p.requires_grad for p in model.parameters()):
        # Nothing to train (a frozen stem tied to the output, parts without
        # parameters): the stem trains, as a user's model would need. Here, not
        # in plan(), so that no other seed's model changes.
        model.requires_grad_(True)
    return model


def make_batch(seed: int, gen: torch.Generator) -> torch.Tensor:
    arch = plan(seed)
    if arch.vocab:
        return torch.randint(0, arch.vocab, (2, arch.seq), generator=gen)
    return torch.randn(2, arch.seq, arch.width_in, generator=gen)


def loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def frozen_names(seed: int) -> tuple[str, ...]:
    """The parameters the model freezes itself: the harness sets
    ``requires_grad`` from ``Scenario.freeze`` and would unfreeze them."""
    return tuple(n for n, p in make_model(seed).named_parameters() if not p.requires_grad)


def scenario(seed: int, backend: str, strategies: bool = False, world_size: int = 1, **compile_kwargs) -> Scenario:
    """Seed ``seed`` under fxshard's defaults but ``backend`` (and, for a
    diagnosis, ``compile_kwargs``): 3 AdamW steps against the reference.
    ``strategies``: under the seed's own strategy (``strategy``) instead."""
    sc = Scenario(make_model=functools.partial(make_model, seed), make_batch=functools.partial(make_batch, seed),
                  loss=loss, compile_kwargs=dict(backend=backend, **compile_kwargs), freeze=frozen_names(seed),
                  param_grad_floor=1e-6)  # fmt: skip
    if not strategies:
        return sc
    fields, options = strategy(seed, world_size)
    return dataclasses.replace(sc, compile_kwargs={**sc.compile_kwargs, **options}, **fields)


def strategy(seed: int, world_size: int) -> tuple[dict, dict]:
    """Scenario fields and ``fxshard.compile`` options for one seed's strategy, drawn from a stream of its
    own: a ZeRO stage, one module or parameter kept whole (``no_shard``),
    frozen parameters sharded or not, micro-batches with or without sync,
    and an HSDP mesh where the world size splits."""
    rng = random.Random(f"strategy {seed}")
    kwargs = dict(zero_stage=rng.choice((1, 2, 3)), shard_frozen=rng.random() < 0.3)
    micro_batches = rng.choice((1, 2, 3))
    whole = rng.random()  # which module no_shard marks: drawn from the model, alike on every rank

    def prepare(model: nn.Module) -> None:
        if whole < 0.5:
            return
        modules = [m for m in model.modules() if m is not model and any(True for _ in m.parameters())]
        fxshard.no_shard(modules[int(whole * 1000) % len(modules)])

    fields = dict(prepare=prepare, micro_batches=micro_batches, no_sync=micro_batches > 1 and rng.random() < 0.7)
    if world_size % 2 == 0 and world_size > 2 and rng.random() < 0.5:
        fields["replicas"] = 2
    return fields, kwargs


def describe_strategy(sc: Scenario) -> str:
    """The options a failure ran under, for its message."""
    return (f"options {sc.compile_kwargs}, micro-batches {sc.micro_batches}{' without sync' if sc.no_sync else ''}, "
            f"replicas {sc.replicas or 1}\n")  # fmt: skip


def parse_seeds(text: str) -> list[int]:
    """``"200"``: seeds 0..199; ``"5-9"``: 5..9; ``"1,4,7"``: those."""
    if "," in text:
        return [int(s) for s in text.split(",")]
    if "-" in text:
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return list(range(int(text)))


def _outcome(seed: int, backend: str, rank: int, world_size: int, compile_kwargs: dict,
             strategies: bool) -> str | None:  # fmt: skip
    """None if ``seed`` matched the reference, else why not."""
    mismatches: list[str] = []
    sc = scenario(seed, backend, strategies, world_size, **compile_kwargs)
    try:
        train_and_compare(rank, world_size, sc, mismatches=mismatches)
    except Exception:
        return describe_strategy(sc) + traceback.format_exc()
    if not mismatches:
        return None
    names = [m.split(":")[0] for m in mismatches]
    return describe_strategy(sc) + f"{len(mismatches)} mismatches ({', '.join(names[:8])}{', ...' if len(names) > 8 else ''}); first:\n" \
           f"{mismatches[0]}"  # fmt: skip


def run_seeds(rank: int, world_size: int, seeds: list[int], backend: str, log_dir: str | None = None,
              compile_kwargs: dict | None = None, strategies: bool = False) -> dict[int, str | None]:  # fmt: skip
    """Train and compare each seed on this rank; map it to None (passed) or
    the failure. With ``log_dir``, append one JSON line per seed to
    ``rank<r>.jsonl`` there as it finishes, so a hang loses only the rest."""
    results: dict[int, str | None] = {}
    for seed in seeds:
        print(f"[rank {rank}/{world_size}] zoo {backend} {plan(seed).describe()}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        results[seed] = _outcome(seed, backend, rank, world_size, compile_kwargs or {}, strategies)
        # Each compiled root has its own forward code object, but dynamo's
        # caches keep every compiled model alive; start each seed clean.
        torch._dynamo.reset()
        if log_dir is not None:
            line = dict(seed=seed, world_size=world_size, backend=backend, rank=rank, error=results[seed],
                        seconds=round(time.perf_counter() - start, 2), arch=plan(seed).describe())  # fmt: skip
            with open(os.path.join(log_dir, f"rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")
    return results


def failures(results: list[dict[int, str | None]]) -> dict[int, str]:
    """Per failed seed, the first failing rank's message, naming the architecture."""
    failed: dict[int, str] = {}
    for rank, per_seed in enumerate(results):
        for seed, error in per_seed.items():
            if error is not None and seed not in failed:
                failed[seed] = f"{plan(seed).describe()}\nrank {rank}: {error}"
    return failed
