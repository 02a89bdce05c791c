"""Layers compiled once take inputs of any tensor property (issue: Llama 3's
complex RoPE crashed every outlined layer). torch has no ``invoke_subgraph``
kernel for a tensor with a lazy conjugate or negative bit ("could not find
kernel for HigherOrderOperator invoke_subgraph at dispatch key Conjugate" /
"Negative"), so a layer's inputs with either bit are resolved before its
call, in forward (here) and in backward (what autograd saves: Llama 3 in
tests/test_torchtitan.py). Each case: 3 alike layers that all read one
tensor made outside them, trained at 2 gloo ranks under the default options
against unsharded training, with the layers outlined."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxshard
from tests.helpers.distributed import check_results, run_ranks

CASES = {
    "conj": lambda cbuf, rbuf, t: cbuf[:t].conj(),  # complex, with the conjugate bit
    "neg": lambda cbuf, rbuf, t: cbuf[:t].conj().imag,  # real, with the negative bit
    "neg_offset": lambda cbuf, rbuf, t: cbuf[1 : 1 + t].conj().imag,  # and at an offset into its buffer
    "offset": lambda cbuf, rbuf, t: rbuf[1 : 1 + 16 * t].view(t, 16),  # a buffer's view at an odd offset
}


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if s.is_complex():
            h = torch.view_as_complex(self.lin(x).reshape(x.shape[0], -1, 2).contiguous())
            return x + torch.view_as_real(h * s[:, : h.shape[1]]).reshape(x.shape)
        return x + torch.tanh(self.lin(x)) * s


class Model(nn.Module):
    def __init__(self, case: str, dim: int = 16) -> None:
        super().__init__()
        self.case = case
        self.layers = nn.ModuleList(Layer(dim) for _ in range(3))
        self.register_buffer("cbuf", torch.randn(64, dim, dtype=torch.complex64))
        self.register_buffer("rbuf", torch.randn(70 * dim + 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = CASES[self.case](self.cbuf, self.rbuf, x.shape[0])
        for layer in self.layers:
            x = layer(x, s)
        return x


def check_cases(rank: int, world_size: int, cases: list[str]) -> dict:
    errors = {}
    for case in cases:
        name, _, backend = case.partition("@")
        try:
            device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
            torch.manual_seed(0)
            model = Model(name).to(device)
            ref = copy.deepcopy(model)
            fxshard.compile(model, backend=backend)
            xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(r)).to(device) for r in range(world_size)]
            for _ in range(2):
                model(xs[rank]).square().mean().backward()
                (sum(ref(x).square().mean() for x in xs) / world_size).backward()
                for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                    torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-5, rtol=1e-4, msg=name)
                    p.grad = q.grad = None
            # Outlined, not kept inline (the first layer may differ: it reads the graph's input).
            assert any(len(body) >= 2 for g in model.fxshard_plan.graphs for body in g.outline.bodies)
        except Exception as error:  # every case reports
            errors[case] = f"{type(error).__name__}: {error}"
        torch._dynamo.reset()
    return errors


RUNS = [f"{name}@aot_eager" for name in CASES] + ["conj@inductor", "neg@inductor"]
# Under [Note: full_cpu]: the views at an offset under Inductor, whose code
# assumes aligned inputs (on GPUs it must copy a misaligned one first).
FULL_RUNS = ["neg_offset@inductor", "offset@inductor"]


@pytest.fixture(scope="module")
def outcomes():
    results = run_ranks(2, check_cases, RUNS, timeout=600)
    check_results(results)
    return results


@pytest.fixture(scope="module")
def full_outcomes():
    results = run_ranks(2, check_cases, FULL_RUNS, timeout=600)
    check_results(results)
    return results


def _failures(outcomes: list[dict], case: str) -> list[str]:
    return [f"rank {r}: {res[case]}" for r, res in enumerate(outcomes) if case in res]


@pytest.mark.parametrize("case", RUNS)
def test_outlined_layers_take_any_input(outcomes, case):
    failures = _failures(outcomes, case)
    assert not failures, "\n".join(failures)


@pytest.mark.full_cpu
@pytest.mark.parametrize("case", FULL_RUNS)
def test_outlined_layers_take_views_at_an_offset_under_inductor(full_outcomes, case):
    failures = _failures(full_outcomes, case)
    assert not failures, "\n".join(failures)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_outlined_layers_take_any_input_on_gpus():
    """Every case with NCCL, where Inductor's code for an outlined layer
    assumes 16-byte-aligned inputs (a view at an odd offset must be copied
    first, or the kernel reads a misaligned address)."""
    results = run_ranks(2, check_cases, RUNS + FULL_RUNS, timeout=600, backend="nccl")
    check_results(results)
    failures = [f"rank {r} {case}: {err}" for r, res in enumerate(results) for case, err in res.items()]
    assert not failures, "\n".join(failures)
