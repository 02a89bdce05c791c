"""Checks of ``fxshard.cuda_graph``, run inside each rank.

Used by ``tests/test_cuda_graph_gpu.py`` (NCCL on 2 GPUs) and
``tests/test_cuda_graph.py`` (the errors that need no GPU).

The bitwise checks build two models alike (same seed, same options) and train
one in a plain loop and the other through ``fxshard.cuda_graph``, on the same
batches (a new one each step), with the same fused, capturable AdamW and
the same ``zero_grad`` on both sides (``set_to_none=False``, or True
where the case says). Every step's loss, and after
the steps every parameter's local shard and every optimizer state tensor,
must be bitwise equal: a replay runs the kernels and collectives the plain
step runs, on the same data.

The error checks require a ``ValueError`` whose message starts with
"fxshard.cuda_graph", raised before any collective of the capture: after it,
no stream is capturing, the capture call issued no collective on any group
(each group's sequence number is unchanged) and left the parameters and
gradients as they were, and the ranks agree on every group's sequence number.
"""

from __future__ import annotations

import gc
import io
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import distributed_c10d as c10d
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from examples.llama import Llama, LlamaConfig, lm_loss
from tests.helpers import hf_models, models
from tests.helpers.parity import _device, run_each

WARMUP = 2
BF16 = fxshard.MixedPrecision(torch.bfloat16, torch.float32)
# What both sides of a bitwise check step with (a test on CPU may replace it).
OPTIMIZER_KWARGS: dict[str, Any] = dict(lr=1e-3, fused=True, capturable=True)
_KEPT: list[Any] = []  # captured steps kept alive to interpreter exit (teardown)


def deterministic() -> None:
    """Before any CUDA work of the rank: cuBLAS and the other kernels pick one
    algorithm, so a replay and a plain step can be compared bit for bit."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def _logits_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(tokens), labels)


def _inside_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(tokens, labels)  # the model computes the loss in its compiled graph


def _hf_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=labels).loss


@dataclass(frozen=True)
class Case:
    make_model: Callable[[], nn.Module]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    vocab: int
    batch: tuple[int, int] = (2, 16)  # rows, tokens per row (per micro-batch)
    compile_kwargs: dict = field(default_factory=dict)
    micro_batches: int = 1  # >1: forward and backward per micro-batch, one optimizer step
    no_sync: bool = False  # all micro-batches but the last under set_requires_gradient_sync(False)
    steps: int = 20
    prepare: Callable[[nn.Module], None] | None = None  # on the built model, before compile
    # HSDP over all ranks: "replicate" is a (world, 1) mesh, "shard" a (1, world) one.
    hsdp: str | None = None
    # >0: the captured function is one micro-batch's forward and backward, called
    # this many times per optimizer step, which runs outside the graph.
    calls_per_step: int = 0
    # zero_grad(set_to_none=...) after each optimizer step: True lets the
    # captured backward's gradients become .grad, in the graph's pool.
    set_to_none: bool = False


def _small_llama() -> nn.Module:
    return Llama(LlamaConfig(vocab=101, dim=64, layers=2, heads=4, hidden=170, max_len=64))


def _activation_llama() -> nn.Module:
    """Activations outweigh the weights: dim 256, 4 layers, seq 512, batch 4."""
    return Llama(LlamaConfig(vocab=1000, dim=256, layers=4, heads=4, hidden=688, max_len=512))


def _wide_hybrid() -> nn.Module:
    return models.Hybrid(vocab=1001, dim=128, heads=4, max_len=256)


LLAMA = dict(make_model=_small_llama, loss=_logits_loss, vocab=101)
HYBRID = dict(make_model=models.Hybrid, loss=_inside_loss, vocab=41)
MODELS = {
    "llama": LLAMA,
    "hybrid": HYBRID,
    "hf_llama": dict(make_model=hf_models.llama, loss=_hf_loss, vocab=hf_models.VOCAB),
    "hf_mamba2": dict(make_model=hf_models.mamba2, loss=_hf_loss, vocab=hf_models.VOCAB),
}


def _freeze_and_replicate(model: nn.Module) -> None:
    """Mixed placements: a frozen (replicated) embedding and first layer,
    a no_shard (all-reduced) norm and last layer, the rest sharded."""
    for p in [*model.embed.parameters(), *model.layers[0].parameters()]:
        p.requires_grad_(False)
    fxshard.no_shard(model.norm)
    fxshard.no_shard(model.layers[-1])


SMALL_UNITS = dict(unit_mb=0.003, compile_blocks_once=False)  # several units, so prefetch and reduces matter
CASES: dict[str, Case] = {
    **{
        f"bitwise-{model}-{precision}": Case(**kwargs, compile_kwargs=dict(mp_policy=mp))
        for model, kwargs in MODELS.items()
        for precision, mp in (("fp32", None), ("bf16", BF16))
    },
    "llama-keep_full": Case(**LLAMA, compile_kwargs=dict(reshard_after_forward=False)),
    "llama-prefetch0": Case(**LLAMA, compile_kwargs=dict(**SMALL_UNITS, prefetch=0)),
    "llama-prefetch2": Case(**LLAMA, compile_kwargs=dict(**SMALL_UNITS, prefetch=2)),
    "llama-reduces_in_flight2": Case(**LLAMA, compile_kwargs=dict(**SMALL_UNITS, reduces_in_flight=2)),
    "accumulate-llama": Case(**LLAMA, micro_batches=3, steps=8),
    "accumulate-hybrid": Case(**HYBRID, micro_batches=3, steps=8),
    "accumulate-no_sync-llama": Case(**LLAMA, micro_batches=3, steps=8, no_sync=True),
    "accumulate-no_sync-hybrid": Case(**HYBRID, micro_batches=3, steps=8, no_sync=True),
    "strategies-llama-bf16": Case(**LLAMA, prepare=_freeze_and_replicate, compile_kwargs=dict(mp_policy=BF16)),
    "strategies-hybrid-fp32": Case(**HYBRID, prepare=_freeze_and_replicate),
    "accumulate-no_sync-strategies-llama": Case(
        **LLAMA, micro_batches=3, steps=8, no_sync=True, prepare=_freeze_and_replicate
    ),
    # ZeRO-1: the full copies gathered inside the captured step, once per step.
    "strategies-zero1-llama": Case(**LLAMA, micro_batches=3, steps=8, compile_kwargs=dict(zero_stage=1)),
    "strategies-zero1-hybrid-bf16": Case(**HYBRID, compile_kwargs=dict(zero_stage=1, mp_policy=BF16)),
    "strategies-zero1-no_sync-llama": Case(
        **LLAMA, micro_batches=3, steps=8, no_sync=True, compile_kwargs=dict(zero_stage=1)
    ),
    # The optimizer steps outside the graph, every 4 calls: the capture (the
    # third call) comes mid-step, and every replay must still gather.
    "strategies-zero1-step_outside-llama": Case(**LLAMA, compile_kwargs=dict(zero_stage=1), calls_per_step=4, steps=12),
    "strategies-hsdp-replicate-llama": Case(**LLAMA, hsdp="replicate", prepare=_freeze_and_replicate),
    "strategies-hsdp-shard-hybrid": Case(**HYBRID, hsdp="shard", micro_batches=3, steps=8, no_sync=True),
    "bitwise-grads_none-llama-bf16": Case(**LLAMA, set_to_none=True, compile_kwargs=dict(mp_policy=BF16)),
    "bitwise-grads_none-hybrid": Case(**HYBRID, set_to_none=True, micro_batches=3, steps=8, no_sync=True),
    "memory-grads_none-llama": Case(
        make_model=_activation_llama, loss=_logits_loss, vocab=1000, batch=(4, 512), steps=3, set_to_none=True
    ),  # fmt: skip
    "memory-hybrid": Case(make_model=_wide_hybrid, loss=_inside_loss, vocab=1001, batch=(4, 256), steps=3),
    "memory-llama": Case(make_model=_activation_llama, loss=_logits_loss, vocab=1000, batch=(4, 512), steps=3),
}


def _build(case: Case, device: torch.device, backend: str | None) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = case.make_model().to(device)
    if case.prepare is not None:
        case.prepare(model)
    mesh = None
    if case.hsdp is not None:
        world = dist.get_world_size()
        shape = (world, 1) if case.hsdp == "replicate" else (1, world)
        mesh = init_device_mesh("cuda", shape, mesh_dim_names=("replicate", "shard"))
    fxshard.compile(model, mesh, **case.compile_kwargs, **({"backend": backend} if backend else {}))
    return model, torch.optim.AdamW(model.parameters(), **OPTIMIZER_KWARGS)


def _batch(case: Case, step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (case.micro_batches, *case.batch) if case.micro_batches > 1 else case.batch
    tokens = torch.randint(0, case.vocab, shape, generator=torch.Generator().manual_seed(1000 * step + rank))
    tokens = tokens.to(device)
    return tokens, tokens.clone()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, case: Case) -> Callable[..., torch.Tensor]:
    """One optimizer step: the plain side calls it, the other wraps it."""

    def step(tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if case.micro_batches == 1:
            loss = case.loss(model, tokens, labels)
            loss.backward()
        else:
            losses = []
            for i in range(case.micro_batches):
                if case.no_sync:
                    model.set_requires_gradient_sync(i == case.micro_batches - 1)
                micro = case.loss(model, tokens[i], labels[i]) / case.micro_batches
                micro.backward()
                losses.append(micro.detach())
            loss = torch.stack(losses).sum()
        if not case.calls_per_step:
            opt.step()
            opt.zero_grad(set_to_none=case.set_to_none)
        return loss.detach()

    return step


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


Trained = tuple[nn.Module, torch.optim.Optimizer]


def _state_differences(a: Trained, b: Trained) -> list[str]:
    """Every parameter's local shard and optimizer state tensor of ``a`` not
    bitwise equal to ``b``'s."""
    (model_a, opt_a), (model_b, opt_b) = a, b
    out = []
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters(), strict=True):
        if not torch.equal(_local(p.detach()), _local(q.detach())):
            diff = (_local(p.detach()).float() - _local(q.detach()).float()).abs().max().item()
            out.append(f"param {name}: max abs difference {diff:.3g}")
        state_a, state_b = opt_a.state[p], opt_b.state[q]
        # A trained parameter with no state: the optimizer never stepped it.
        if sorted(state_a) != sorted(state_b) or (not state_a and p.requires_grad):
            out.append(f"optimizer state of {name}: keys {sorted(state_a)} against {sorted(state_b)}")
            continue
        for key, value in state_a.items():
            if isinstance(value, torch.Tensor) and not torch.equal(_local(value), _local(state_b[key])):
                out.append(f"optimizer state {key!r} of {name} differs")
    return out


def bitwise_check(rank: int, world_size: int, name: str, backend: str | None = None) -> None:
    """``CASES[name]`` through a plain loop and through ``fxshard.cuda_graph``:
    the losses, the shards and the optimizer states bitwise equal."""
    case, device = CASES[name], _device(rank)
    plain, graphed = _build(case, device, backend), _build(case, device, backend)
    plain_step = train_step(*plain, case)
    graph_step = fxshard.cuda_graph(train_step(*graphed, case), warmup=WARMUP)
    batches = [_batch(case, step, rank, device) for step in range(case.steps)]

    def losses(step: Callable, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
        out = []
        for i, batch in enumerate(batches):
            out.append(step(*batch).clone())
            if case.calls_per_step and (i + 1) % case.calls_per_step == 0:
                opt.step()
                opt.zero_grad(set_to_none=case.set_to_none)
        return out

    plain_losses, graph_losses = losses(plain_step, plain[1]), losses(graph_step, graphed[1])
    failures = [f"step {i} loss: plain {p.item()!r}, graph {g.item()!r}"
                for i, (p, g) in enumerate(zip(plain_losses, graph_losses)) if not torch.equal(p, g)]  # fmt: skip
    failures += _state_differences(plain, graphed)
    graph_step.reset()
    assert not failures, f"rank {rank} {name}:\n" + "\n".join(failures)


def memory_check(rank: int, world_size: int, name: str, backend: str | None = None) -> None:
    """After capture, the predicted peak is within 5% of the measured one."""
    case, device = CASES[name], _device(rank)
    model, opt = _build(case, device, backend)
    step = fxshard.cuda_graph(train_step(model, opt, case), warmup=WARMUP)
    for i in range(case.steps):
        step(*_batch(case, i, rank, device))
    m = step.memory
    off = (m.predicted_peak - m.measured_peak) / max(m.measured_peak, 1)
    report = (f"rank {rank} {name}: predicted_peak {m.predicted_peak} B, measured_peak {m.measured_peak} B "
              f"({off:+.1%}), pool_reserved {m.pool_reserved} B, persistent {m.persistent} B")  # fmt: skip
    print(report, file=sys.stderr, flush=True)
    step.reset()
    assert m.measured_peak > 0, report
    assert abs(m.predicted_peak - m.measured_peak) <= 0.05 * m.measured_peak, report


# -- errors ----------------------------------------------------------------------------------------------------


def sequence_numbers() -> dict[str, int]:
    """Each live process group's count of collectives issued so far."""
    return {pg.group_name: pg._get_sequence_number_for_group() for pg in list(c10d._world.pg_map)}


def _snapshot(model: nn.Module) -> list[torch.Tensor]:
    return [_local(t.detach()).clone() for p in model.parameters() for t in (p, p.grad) if t is not None]


def _unchanged(before: list[torch.Tensor], model: nn.Module) -> bool:
    after = _snapshot(model)
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def expect_error(step: Callable, calls: list[tuple], pattern: str, model: nn.Module, *, last_call: int,
                 calls_before: int = 0) -> int:  # fmt: skip
    """Call ``step`` with each argument tuple until it raises; check the
    error and that it came before any collective of a capture. Return the
    index of the call that raised (counting the ``calls_before`` made
    already), which must be at most ``last_call``."""
    for i, args in enumerate(calls, start=calls_before):
        sequence, state = sequence_numbers(), _snapshot(model)
        try:
            step(*args)
        except ValueError as error:
            message = str(error)
            assert message.startswith("fxshard.cuda_graph"), f"call {i}: {message}"
            assert re.search(pattern, message, re.IGNORECASE), f"call {i}: does not match {pattern!r}: {message}"
            assert i <= last_call, f"raised at call {i}, after call {last_call}: {message}"
            if torch.cuda.is_available():
                assert not torch.cuda.is_current_stream_capturing(), "a stream is still capturing after the error"
            if i >= WARMUP:  # the capture call, or a replay's: nothing of the graph may have run
                assert sequence_numbers() == sequence, (f"call {i} issued collectives before raising: "
                                                        f"{sequence} -> {sequence_numbers()}")  # fmt: skip
                assert _unchanged(state, model), f"call {i} changed parameters or gradients before raising"
            _ranks_agree()
            return i
        assert i < last_call, f"no error by call {last_call}"
    raise AssertionError("no error raised")


def _ranks_agree() -> None:
    """Every rank issued the same collectives on every group, and the default
    group still works."""
    mine = sequence_numbers()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    assert all(s == mine for s in everyone), f"ranks issued different collectives: {everyone}"


class BreakingNet(nn.Module):
    """A forward with a graph break that reads no tensor value (no host sync):
    fxshard reads its parameters through the sequencer."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(12, 9)
        self.second = nn.Linear(9, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        return self.second(h)


def _mse_step(model: nn.Module, opt: torch.optim.Optimizer | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=False)
        return loss.detach()

    return step


def _inputs(rank: int, device: torch.device, n: int, shape: tuple[int, ...] = (4, 12)) -> list[tuple]:
    return [(torch.randn(shape, generator=torch.Generator().manual_seed(10 * i + rank)).to(device),) for i in range(n)]


def error_sequenced(rank: int, world_size: int, backend: str = "aot_eager") -> None:
    device = _device(rank)
    torch.manual_seed(0)
    model = fxshard.compile(BreakingNet().to(device), backend=backend)
    step = fxshard.cuda_graph(_mse_step(model, torch.optim.AdamW(model.parameters(), **OPTIMIZER_KWARGS)),
                              warmup=WARMUP)  # fmt: skip
    step(*_inputs(rank, device, 1)[0])
    assert model.fxshard_plan.sequenced, "the model must be on the sequenced path for this test"
    expect_error(step, _inputs(rank, device, WARMUP), r"graph break|sequenced", model, last_call=WARMUP, calls_before=1)


def _host_sync_step(model: nn.Module, opt: torch.optim.Optimizer, how: str) -> Callable:
    inner = _mse_step(model, opt)
    sink = io.StringIO()

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = inner(x)
        if how == "item":
            sink.write(f"{loss.item():.3f}")
        else:
            print(loss, file=sink)  # formats the value: a host sync like print(loss)
        return loss

    return step


def error_host_sync(rank: int, world_size: int, how: str, backend: str = "aot_eager") -> None:
    """``loss.item()`` or ``print(loss)`` in the step: found in the last
    warm-up call, before the capture."""
    device = _device(rank)
    torch.manual_seed(0)
    model = fxshard.compile(models.Uneven().to(device), backend=backend)
    step = fxshard.cuda_graph(_host_sync_step(model, torch.optim.AdamW(model.parameters(), **OPTIMIZER_KWARGS), how),
                              warmup=WARMUP)  # fmt: skip
    expect_error(step, _inputs(rank, device, WARMUP + 1, (3, 5)), r"sync|item|print", model, last_call=WARMUP)


def error_optimizer(rank: int, world_size: int, backend: str = "aot_eager") -> None:
    """AdamW without ``capturable=True`` keeps its step count on the host."""
    device = _device(rank)
    torch.manual_seed(0)
    model = fxshard.compile(models.Uneven().to(device), backend=backend)
    step = fxshard.cuda_graph(_mse_step(model, torch.optim.AdamW(model.parameters(), lr=1e-3)), warmup=WARMUP)
    expect_error(step, _inputs(rank, device, WARMUP + 1, (3, 5)), r"capturable", model, last_call=WARMUP)


def error_after_capture(rank: int, world_size: int, change: str, backend: str = "aot_eager") -> None:
    """After the capture, a tensor argument of another shape or dtype, or
    another value of a non-tensor argument: an error before the replay, and
    the graph still replays for the captured arguments."""
    device = _device(rank)
    torch.manual_seed(0)
    model = fxshard.compile(models.Uneven().to(device), backend=backend)
    inner = _mse_step(model, torch.optim.AdamW(model.parameters(), **OPTIMIZER_KWARGS))

    def scaled_step(x: torch.Tensor, scale: float) -> torch.Tensor:
        return inner(x * scale)

    step = fxshard.cuda_graph(scaled_step, warmup=WARMUP)
    good = [(x, 1.0) for (x,) in _inputs(rank, device, WARMUP + 2, (3, 5))]
    for args in good[: WARMUP + 1]:  # warm-up calls, then the capture
        step(*args)
    x = good[-1][0]
    bad, pattern = {"shape": ((x[:2], 1.0), "shape"), "dtype": ((x.double(), 1.0), "dtype"),
                    "non_tensor": ((x, 0.5), r"argument|scale|0\.5")}[change]  # fmt: skip
    expect_error(step, [bad], pattern, model, last_call=WARMUP + 1, calls_before=WARMUP + 1)
    state = _snapshot(model)
    step(*good[-1])
    assert not _unchanged(state, model), "the replay after the error did not step"
    step.reset()


def error_cpu_tensors(rank: int, world_size: int) -> dict:
    """A model on CPU (a gloo group, the default mesh): CUDA graphs need CUDA
    and NCCL. Everything else is capturable; after the error the model still
    trains without the graph."""
    case = CASES["bitwise-hybrid-fp32"]
    model, opt = _build(case, torch.device("cpu"), "aot_eager")
    step = fxshard.cuda_graph(train_step(model, opt, case), warmup=WARMUP)
    calls = [_batch(case, i, rank, torch.device("cpu")) for i in range(WARMUP + 1)]
    expect_error(step, calls, r"cuda|nccl", model, last_call=WARMUP)
    state = _snapshot(model)
    train_step(model, opt, case)(*calls[0])
    assert not _unchanged(state, model)
    return {}


def error_gloo_group_on_cuda(rank: int, world_size: int) -> dict:
    """CUDA tensors, but the mesh's group is gloo: NCCL is needed."""
    device = torch.device("cuda", torch.cuda.current_device())
    mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (world_size,))
    assert dist.get_backend(mesh.get_group()) == "gloo"
    torch.manual_seed(0)
    model = fxshard.compile(models.Uneven().to(device), mesh, backend="aot_eager")
    step = fxshard.cuda_graph(_mse_step(model, torch.optim.AdamW(model.parameters(), **OPTIMIZER_KWARGS)),
                              warmup=WARMUP)  # fmt: skip
    expect_error(step, _inputs(rank, device, WARMUP + 1, (3, 5)), r"nccl", model, last_call=WARMUP)
    return {}


ERRORS: dict[str, Callable[[int, int], None]] = {
    "error-sequenced": error_sequenced,
    "error-host_sync_item": lambda r, w: error_host_sync(r, w, "item"),
    "error-host_sync_print": lambda r, w: error_host_sync(r, w, "print"),
    "error-optimizer_not_capturable": error_optimizer,
    "error-shape_changed": lambda r, w: error_after_capture(r, w, "shape"),
    "error-dtype_changed": lambda r, w: error_after_capture(r, w, "dtype"),
    "error-non_tensor_changed": lambda r, w: error_after_capture(r, w, "non_tensor"),
}


# -- teardown --------------------------------------------------------------------------------------------------


def destroy_without_reset(rank: int, world_size: int) -> dict:
    """Capture and replay, then destroy the process group with the graph
    alive, and keep it alive to interpreter exit: neither may hang. The
    decorator's bare form, with its default warm-up (at most 3 calls)."""
    deterministic()
    case, device = CASES["bitwise-llama-fp32"], _device(rank)
    step = fxshard.cuda_graph(train_step(*_build(case, device, None), case))
    for i in range(6):
        loss = step(*_batch(case, i, rank, device))
    assert torch.isfinite(loss).all()
    torch.cuda.synchronize()
    _KEPT.append(step)
    dist.destroy_process_group()
    return {}


def reset_and_capture_again(rank: int, world_size: int) -> dict:
    """Train 6 steps, reset (which gives back the pool), train 6 more through
    a fresh capture: bitwise equal to 12 plain steps."""
    deterministic()
    case, device = CASES["bitwise-hybrid-fp32"], _device(rank)
    plain, graphed = _build(case, device, None), _build(case, device, None)
    batches = [_batch(case, i, rank, device) for i in range(12)]
    plain_step = train_step(*plain, case)
    plain_losses = [plain_step(*b).clone() for b in batches]
    step = fxshard.cuda_graph(train_step(*graphed, case), warmup=WARMUP)
    graph_losses = [step(*b).clone() for b in batches[:6]]
    pool = step.memory.pool_reserved
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    step.reset()
    gc.collect()
    torch.cuda.empty_cache()
    freed = reserved - torch.cuda.memory_reserved()
    assert freed >= pool // 2, f"reset gave back {freed} bytes of a pool of {pool}"
    graph_losses += [step(*b).clone() for b in batches[6:]]
    failures = [f"step {i} loss" for i, (p, g) in enumerate(zip(plain_losses, graph_losses)) if not torch.equal(p, g)]
    failures += _state_differences(plain, graphed)
    step.reset()
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)
    return {}


# -- groups ----------------------------------------------------------------------------------------------------


def _run_one(rank: int, world_size: int, name: str, backend: str | None) -> None:
    if name in ERRORS:
        ERRORS[name](rank, world_size)
    elif name.startswith("memory-"):
        memory_check(rank, world_size, name, backend)
    else:
        bitwise_check(rank, world_size, name, backend)
    gc.collect()


def run_cases(rank: int, world_size: int, names: list[str], backend: str | None = None) -> dict[str, str | None]:
    """Each named case, each from a clean dynamo; map it to None (passed) or its traceback."""
    deterministic()
    return run_each(rank, world_size, names, lambda r, w, name: _run_one(r, w, name, backend))
