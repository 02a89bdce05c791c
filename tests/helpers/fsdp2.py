"""Helpers for tests/test_fsdp2_conformance.py: FSDP2's test models, a
parity harness against an unsharded reference, and a runner that gives each
scenario its own result.

The reference is the same model, unsharded, in the same process. Each rank
trains the compiled model on its own batch; the reference runs every rank's
batch and averages the gradients, which is what data-parallel training must
compute. Mixed precision is emulated as fxshard documents it: the reference
computes in a ``param_dtype`` copy of fp32 master weights, casts each rank's
gradient to ``reduce_dtype``, averages, and steps the fp32 master weights.
"""

from __future__ import annotations

import copy
import sys
import time
import traceback
import types
import unittest
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

import fxshard

GRAD_TOL = 1e-5  # largest gradient difference over the reference's largest gradient (fp32)
PARAM_ATOL, PARAM_RTOL = 5e-5, 1e-4  # parameters after Adam steps at lr=1e-2 (fp32)
LOSS_TOL = 1e-5
# Parameters are compared only at elements whose reference gradient exceeded
# this fraction of the largest gradient at every step so far: Adam turns the
# rounding noise on a (near-)zero gradient (a dead ReLU) into a step of ~lr.
GRAD_FLOOR = 1e-3


def fsdp2_models() -> types.SimpleNamespace:
    """FSDP2's own test models, imported from the installed torch (not
    copied): ``MLP``, ``MLPStack``, ``DoubleLinear`` from common_fsdp, and
    ``Transformer``, ``TransformerBlock``, ``ModelArgs`` from common_dtensor.

    torch's ``common_utils`` imports ``expecttest`` (a torch development
    dependency that the test extra does not install) only for its TestCase
    base class, which these models never touch: without the package, a
    stand-in module with a plain ``unittest.TestCase`` is put in its place."""
    try:
        import expecttest  # noqa: F401
    except ModuleNotFoundError:
        stand_in = types.ModuleType("expecttest")

        class TestCase(unittest.TestCase):
            pass

        stand_in.TestCase = TestCase
        sys.modules["expecttest"] = stand_in
    from torch.testing._internal.common_fsdp import MLP, DoubleLinear, MLPStack
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

    return types.SimpleNamespace(MLP=MLP, MLPStack=MLPStack, DoubleLinear=DoubleLinear, Transformer=Transformer,
                                 TransformerBlock=TransformerBlock, ModelArgs=ModelArgs)  # fmt: skip


def shard(model: nn.Module, **kwargs: Any) -> nn.Module:
    """``fxshard.compile`` with the suite's default compiler (aot_eager: CPU time)."""
    kwargs.setdefault("backend", "aot_eager")
    return fxshard.compile(model, **kwargs)


def gen(step: int, rank: int, micro: int = 0) -> torch.Generator:
    """The generator of rank ``rank``'s data at ``step`` and micro-batch ``micro``."""
    return torch.Generator().manual_seed(1000 * step + 10 * rank + micro)


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    """A DTensor's full value (a collective for sharded ones), a plain tensor as it is."""
    if t is None:
        return None
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class Checks:
    """Records differences and goes on, so that every rank runs the scenario
    to its end and issues the same collectives (a compare raising on one rank
    only would leave the others waiting); ``done()`` raises with all of them."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def true(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)

    def close(self, actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 0.0,
              rtol: float = 0.0) -> None:  # fmt: skip
        try:
            torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
        except AssertionError as error:
            self.failures.append(f"{what}: {error}")

    def done(self) -> None:
        if self.failures:
            shown = "\n".join(self.failures[:12])
            more = f"\n... and {len(self.failures) - 12} more" if len(self.failures) > 12 else ""
            raise AssertionError(f"{len(self.failures)} difference(s) from the reference:\n{shown}{more}")


def default_fwd_bwd(model: nn.Module, batch: tuple) -> torch.Tensor:
    """FSDP2's tests' loss: the sum of the output. Backward runs here."""
    loss = model(*batch).sum()
    loss.backward()
    return loss.detach()


def _cast_floats(batch: Any, dtype: torch.dtype) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, (tuple, list)):
        return type(batch)(_cast_floats(b, dtype) for b in batch)
    return batch


@dataclass
class ParityResult:
    model: nn.Module
    master: nn.Module
    opt: torch.optim.Optimizer
    losses: list[list[float]]  # per step, per micro-batch: the mean over ranks
    zero_for_none: list[str]  # "step s: name" where fxshard gave zeros and the reference None


def parity(
    model: nn.Module,
    batch: Callable[[int, int, int], tuple],
    *,
    fwd_bwd: Callable[[nn.Module, tuple], torch.Tensor] = default_fwd_bwd,
    steps: int = 3,
    micro: int = 1,
    sync: Callable[[int, int], bool | None] | None = None,
    sync_recurse: bool = True,
    units: Callable[[nn.Module], list[nn.Module]] | None = None,
    prepare: Callable[[nn.Module], Any] | None = None,
    after_compile: Callable[[nn.Module, nn.Module], Any] | None = None,
    before_step: Callable[[int, nn.Module, list[nn.Module], Checks], Any] | None = None,
    set_to_none: Callable[[int], bool] = lambda step: step % 2 == 0,
    mp: fxshard.MixedPrecision | None = None,
    grad_tol: float = GRAD_TOL,
    param_atol: float = PARAM_ATOL,
    param_rtol: float = PARAM_RTOL,
    loss_tol: float = LOSS_TOL,
    grad_floor: float = GRAD_FLOOR,
    none_may_be_zero: bool = False,
    check_params: bool = True,
    reference: nn.Module | None = None,
    compare_keys: bool = True,
    **compile_kwargs: Any,
) -> ParityResult:
    """Train ``model`` compiled with fxshard and an unsharded copy of it side
    by side; raise at the end with every difference in the losses, the
    gradients (scaled by the largest) and the updated parameters.

    - ``batch(step, micro, rank)``: the call arguments of rank ``rank``.
    - ``fwd_bwd(model, args)``: forward, loss, backward; returns the loss.
    - ``sync(step, micro)``: if not None, ``set_requires_gradient_sync`` before that micro-batch.
    - ``prepare(model)``: on the model to compile only, before compile (``no_shard``, freezing).
    - ``after_compile(model, master)``: after compile (freezing after init);
      the reference's compute copy is made after it.
    - ``before_step(step, model, [master, compute], checks)``: after the
      gradients are compared, before the optimizer steps (clipping, freezing).
    - ``reference``: ``model`` is compiled already and this is its unsharded copy.
    - ``mp``: ``mp_policy``, emulated by the reference (see the module docstring).
    - ``none_may_be_zero``: accept a zero gradient where the reference has
      none (docs/limits.md: outputs the loss does not use give zero
      gradients), recorded in ``zero_for_none``, and step the reference with
      that zero gradient too.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if reference is None:
        master = copy.deepcopy(model)
        if prepare is not None:
            prepare(model)
        if units is not None:
            compile_kwargs["units"] = units(model)
        if mp is not None:
            compile_kwargs["mp_policy"] = mp
        shard(model, **compile_kwargs)
    else:
        master = reference
    if after_compile is not None:
        after_compile(model, master)
    compute_dtype = mp.param_dtype if mp is not None and mp.param_dtype is not None else None
    reduce_dtype = mp.reduce_dtype if mp is not None and mp.reduce_dtype is not None else compute_dtype
    compute = copy.deepcopy(master)
    if compute_dtype is not None:
        compute = compute.to(compute_dtype)
    masters, computes = list(master.parameters()), list(compute.parameters())
    # eps=1e-6, not 1e-8: see tests/helpers/parity.py (reduction-order noise near 1e-8 grows through Adam).
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.Adam(master.parameters(), lr=1e-2, eps=1e-6)
    checks = Checks()
    compared = [torch.ones_like(m, dtype=torch.bool) for m in masters]
    losses: list[list[float]] = []
    zero_for_none: list[str] = []
    for step in range(steps):
        step_losses = []
        summed: list[torch.Tensor | None] = [None] * len(masters)
        for i in range(micro):
            if sync is not None and sync(step, i) is not None:
                model.set_requires_gradient_sync(sync(step, i), recurse=sync_recurse)
            local = fwd_bwd(model, batch(step, i, rank)).float().reshape(1)
            gathered = [torch.zeros_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            ref_losses = []
            for r in range(world):
                args = batch(step, i, r)
                if compute_dtype is not None and (mp is None or mp.cast_forward_inputs):
                    args = _cast_floats(args, compute_dtype)
                compute.zero_grad(set_to_none=True)
                ref_losses.append(fwd_bwd(compute, args).float())
                for j, c in enumerate(computes):
                    if c.grad is not None:
                        g = c.grad.to(reduce_dtype) if reduce_dtype is not None else c.grad
                        summed[j] = g if summed[j] is None else summed[j] + g
            mean, ref_mean = torch.cat(gathered).mean(), torch.stack(ref_losses).mean()
            checks.close(mean, ref_mean, f"step {step} micro {i} loss", atol=loss_tol, rtol=loss_tol)
            step_losses.append(mean.item())
        losses.append(step_losses)
        # The reference's gradients: this step's average, added to what zero_grad(set_to_none=False) left.
        for m, s in zip(masters, summed):
            if s is not None:
                g = (s / world).to(m.dtype)
                m.grad = g if m.grad is None else m.grad + g
        named = list(model.named_parameters())
        largest = max((m.grad.abs().max().item() for m in masters if m.grad is not None), default=0.0) or 1.0
        for (name, p), m, mask in zip(named, masters, compared):
            got = full(p.grad)
            if got is not None and m.grad is None and none_may_be_zero and not got.any():
                zero_for_none.append(f"step {step}: {name}")
                m.grad = torch.zeros_like(m)
            if (got is None) != (m.grad is None):
                checks.true(False, f"step {step}: {name}.grad is {'None' if got is None else 'set'} "
                                   f"but the reference's is {'None' if m.grad is None else 'set'}")  # fmt: skip
                continue
            if got is None:
                continue
            checks.true(got.dtype == p.dtype, f"{name}: grad dtype {got.dtype}, parameter dtype {p.dtype}")
            worst = (got.float() - m.grad.float()).abs().max().item() / largest if got.numel() else 0.0
            checks.true(worst <= grad_tol, f"step {step}: grad of {name} off by {worst:.2e} of the largest")
            mask &= m.grad.abs() > grad_floor * largest
        if before_step is not None:
            before_step(step, model, [master, compute], checks)
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=set_to_none(step))
        ref_opt.zero_grad(set_to_none=set_to_none(step))
        with torch.no_grad():
            for c, m in zip(computes, masters):
                c.copy_(m)
        if check_params:
            for (name, p), m, mask in zip(named, masters, compared):
                value = p.detach().full_tensor()
                checks.close(value[mask].float(), m.detach()[mask].float(), f"step {step}: {name} after the step",
                             atol=param_atol, rtol=param_rtol)  # fmt: skip
    if compare_keys:
        keys, ref_keys = list(model.state_dict()), list(master.state_dict())
        checks.true(keys == ref_keys, f"state_dict keys {keys} differ from the unsharded model's {ref_keys}")
    checks.done()
    return ParityResult(model, master, opt, losses, zero_for_none)


def run_scenarios(rank: int, world_size: int, names: Iterable[str],
                  registry: dict[str, Callable[[int, int], Any]]) -> dict[str, str | None]:  # fmt: skip
    """Run each named scenario from a clean dynamo; map it to None (passed)
    or its failure. A failure on any rank is every rank's: the ranks agree
    on the outcome, so a rank that passed does not run ahead of one that
    raised into the next scenario's collectives."""
    results: dict[str, str | None] = {}
    for name in names:
        print(f"[rank {rank}/{world_size}] {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        torch.manual_seed(0)
        try:
            registry[name](rank, world_size)
            error = None
        except Exception as e:  # every scenario reports; one failure does not hide the others
            error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        outcomes: list[Any] = [None] * world_size
        dist.all_gather_object(outcomes, error)
        failed = [(r, e) for r, e in enumerate(outcomes) if e is not None]
        results[name] = "\n".join(f"rank {r}: {e}" for r, e in failed) if failed else None
        print(f"[rank {rank}/{world_size}] {name} {'FAILED' if failed else 'passed'} in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
        torch._dynamo.reset()
    return results
