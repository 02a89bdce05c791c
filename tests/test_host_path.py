"""The host work of one compiled training step, counted.

A step that the GPU finishes before the host has issued it is host-bound
(small models, MoE): its time is the Python the step runs. Measured on
2 GPUs, every unit cost about 1.5 ms of host time per step, most of it in
two places that scale with the model:

- each runtime op that compiled graphs call (a unit's gather, reduce and
  their waits; the accumulation and replicated-gradient ops) ran through
  ``torch.library.custom_op``'s Python wrappers;
- each parameter's gradient became a DTensor through ``DTensor.from_local``,
  an autograd function that builds a spec per call.

Neither costs anything now (see [Note: runtime ops without custom_op's
wrappers] in fxshard/runtime/library.py, and ``compat.dtensor_of_spec``).
These tests keep it so with counts, which are the same on every run: a
time would be noise in CI.
"""

from __future__ import annotations

import collections
import copy
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate

import fxshard
from examples.llama import Llama, LlamaConfig, lm_loss

# What custom_op runs around an op's function on every call.
_WRAPPERS = ("torch/_library/custom_ops.py", "torch/_library/autograd.py")


@torch.library.custom_op("fxshard_tests::control", mutates_args=())
def _control(x: torch.Tensor) -> torch.Tensor:
    """A custom_op called once in each counted step: the count must see its wrappers."""
    return x.clone()


@_control.register_fake
def _(x):
    return torch.empty_like(x)


def _wrapper_calls(calls) -> dict:
    """custom_op's wrapper frames, less one call of ``_control`` (which must be among them)."""
    wrapped = collections.Counter({key: n for key, n in calls.items() if key[0].endswith(_WRAPPERS)})
    control = collections.Counter(_calls_in_one_step(lambda: _control(torch.zeros(1))))
    control = collections.Counter({key: n for key, n in control.items() if key[0].endswith(_WRAPPERS)})
    assert control and all(wrapped[key] >= n for key, n in control.items()), "the count misses custom_op's wrappers"
    return dict(wrapped - control)


def _calls_in_one_step(step) -> collections.Counter[tuple[str, str]]:
    """(file, function) of every Python call one ``step()`` makes."""
    calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def count(frame, event, arg):
        if event == "call":
            calls[(frame.f_code.co_filename.replace("\\", "/"), frame.f_code.co_name)] += 1

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls


def _llama_step(warm: bool = True, **options):
    """The model and its training step; with ``warm``, after two steps
    (compile, then a step as every later one)."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab=64, dim=32, layers=3, heads=2, hidden=48, max_len=16))
    fxshard.compile(model, backend="aot_eager", **options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.arange(16).reshape(2, 8) * 3 % 64

    def step():
        lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(2 if warm else 0):
        step()
    return model, step


def _calls_to(calls, file_end: str, function: str) -> int:
    return sum(n for (file, fn), n in calls.items() if file.endswith(file_end) and fn == function)


def test_a_step_calls_runtime_ops_without_custom_op_wrappers(fake_pg):
    """Every unit op a step runs is called, and none through custom_op's
    Python wrappers (one unit per block, so that there are several)."""
    _, step = _llama_step(unit_mb=1e-6, sharded_embeddings=False)
    calls = _calls_in_one_step(lambda: (step(), _control(torch.zeros(1))))
    gathers = _calls_to(calls, "fxshard/runtime/units.py", "gather_start")
    reduces = _calls_to(calls, "fxshard/runtime/units.py", "reduce_start")
    assert gathers >= 3 and reduces >= 3, (gathers, reduces)  # else the check below proves nothing
    wrapped = _wrapper_calls(calls)
    assert not wrapped, f"a step ran custom_op's wrappers: {wrapped}"


def test_accumulation_ops_run_without_custom_op_wrappers(fake_pg):
    """Micro-batches without sync accumulate every gradient through runtime ops
    (per parameter), which must not go through custom_op's wrappers either."""
    model, _ = _llama_step(warm=False, sharded_embeddings=False)  # a plain step's graph is not needed here
    tokens = torch.arange(16).reshape(2, 8) * 5 % 64

    def accumulate():
        model.set_requires_gradient_sync(False)
        lm_loss(model(tokens), tokens).backward()
        model.set_requires_gradient_sync(True)
        lm_loss(model(tokens), tokens).backward()

    accumulate()  # compiles the accumulating graphs
    calls = _calls_in_one_step(lambda: (accumulate(), _control(torch.zeros(1))))
    assert _calls_to(calls, "fxshard/runtime/ops.py", "accumulate_grad") > 0
    assert _calls_to(calls, "fxshard/runtime/ops.py", "take_accumulated") > 0
    wrapped = _wrapper_calls(calls)
    assert not wrapped, f"accumulation ran custom_op's wrappers: {wrapped}"


def test_gradients_become_dtensors_without_from_local(fake_pg):
    """The gradients are DTensors laid out as their parameters, made from the
    parameters' own specs: no ``DTensor.from_local`` (an autograd function and
    a new spec per parameter) in a step."""
    model, step = _llama_step()
    p0 = next(model.parameters())

    def backward():
        model(torch.zeros(2, 8, dtype=torch.long)).sum().backward()
        DTensor.from_local(torch.zeros(1), p0.device_mesh, [Replicate()])  # the count must see this one

    calls = _calls_in_one_step(backward)
    assert _calls_to(calls, "torch/distributed/tensor/_api.py", "from_local") == 1
    for name, p in model.named_parameters():
        assert type(p.grad) is DTensor, name
        assert p.grad.placements == p.placements and p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
        assert p.grad.to_local().shape == p.to_local().shape, name
    step()


@pytest.mark.parametrize("layer, op", [(1, "all_reduce_grad"), (0, "reduce_grad")], ids=["replicated", "sharded"])
def test_a_backward_through_a_gradient_raises_naming_the_cause(fake_pg, layer, op):
    """The runtime ops have no autograd kernel. A gradient taken with
    ``create_graph=True`` still works, and a backward through it raises,
    naming the op, rather than differentiating the collective's function.
    On every torch: before 2.13, ``DTensor.to_local``'s backward cut the
    graph short of the op, and nothing raised."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    fxshard.no_shard(model[1])
    fxshard.compile(model, backend="aot_eager")
    weight = model[layer].weight  # the full value, read outside the forward: its gradient is reduced
    (weight**3).sum().backward(create_graph=True)
    shard = dict(model.named_parameters())[f"{layer}.weight"]
    assert shard.grad is not None and shard.grad.requires_grad
    with pytest.raises(RuntimeError, match=f"double backward.*{op}"):
        shard.grad.to_local().sum().backward()


def test_eager_backend_refuses_a_differentiable_parameter_gradient_and_takes_an_input_penalty(no_dist):
    """``backend="eager"`` reduces gradients outside autograd: a backward
    with ``create_graph=True`` through a parameter raises, naming the way
    that works, rather than give ``.grad`` no graph (a gradient penalty on
    it would silently be zero). A penalty on the gradient with respect to
    the inputs (WGAN-GP, R1) matches unsharded training."""
    torch.manual_seed(0)
    model, ref = (torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)) for _ in "ab")
    ref.load_state_dict(model.state_dict())
    fxshard.compile(model, backend="eager")
    x = torch.randn(5, 4)
    with pytest.raises(RuntimeError, match=r"create_graph=True.*'2.weight'.*torch.autograd.grad\(out, inputs"):
        model(x).sum().backward(create_graph=True)
    model.zero_grad()
    for m in (model, ref):
        xg = x.clone().requires_grad_()
        out = m(xg)
        (g,) = torch.autograd.grad(out.sum(), xg, create_graph=True)
        (out.mean() + g.pow(2).sum()).backward()
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), refs[name].grad, msg=name)


def _subclass_dispatches(fn) -> int:
    """How many times ``fn()`` entered a tensor subclass's dispatch (DTensor's:
    the profiler's ``PythonSubclass`` events), C++ fast path or Python."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name == "PythonSubclass")


def test_a_step_dispatches_through_dtensor_no_more_than_plain_dtensors(fake_pg):
    """Host time that grows with the parameters: each operation on a DTensor
    is a subclass dispatch. The forward reads the shards with none; the
    backward none either, setting ``.grad`` and adding to it (autograd's
    ``AccumulateGrad`` would detach or add each DTensor gradient through
    DTensor's dispatch: see [Note: gradients into .grad without
    AccumulateGrad]); the optimizer step as many as over plain DTensors of
    the same shapes."""
    model, step = _llama_step()
    trained = [p for p in model.parameters() if p.requires_grad]
    tokens = torch.arange(16).reshape(2, 8) * 7 % 64
    state = {}
    forward = _subclass_dispatches(lambda: state.setdefault("loss", lm_loss(model(tokens), tokens)))
    backward = _subclass_dispatches(lambda: state["loss"].backward())
    assert forward == 0, f"the forward dispatched {forward} DTensor ops"
    assert backward == 0, f"the backward dispatched {backward} DTensor ops for {len(trained)} gradients"
    assert all(type(p.grad) is DTensor for p in trained)
    again = _subclass_dispatches(lambda: lm_loss(model(tokens), tokens).backward())
    assert again == 0, f"a backward adding to .grad dispatched {again} DTensor ops"

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()  # creates the state, as the plain one's first step below does
    plain = [torch.nn.Parameter(DTensor.from_local(p.to_local().clone(), p.device_mesh, p.placements,
                                                   shape=p.shape, stride=p.stride())) for p in trained]  # fmt: skip
    for q, p in zip(plain, trained):
        q.grad = DTensor.from_local(p.grad.to_local().clone(), p.device_mesh, p.placements, shape=p.shape,
                                    stride=p.stride())  # fmt: skip
    plain_opt = torch.optim.AdamW(plain, lr=1e-3)
    plain_opt.step()
    ours, theirs = _subclass_dispatches(opt.step), _subclass_dispatches(plain_opt.step)
    assert theirs > 0 and ours == theirs, f"optimizer step: {ours} DTensor dispatches, plain DTensors {theirs}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_one_gradient_goes_through_autograd_for_the_streams(no_dist):
    """On a device with streams one gradient is left to autograd, so that
    the engine's wait of the calling stream on its leaves' streams covers
    the gradients fxshard set (see [Note: gradients into .grad without
    AccumulateGrad]): one DTensor dispatch in the backward, not none. The
    gradients then match, with the forward on a side stream and the
    backward called from the default one. At one rank: a fake group's
    collectives leave their outputs unwritten, so its values do not compare."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab=64, dim=32, layers=3, heads=2, hidden=48, max_len=16)).cuda()
    fxshard.compile(model, backend="aot_eager")
    tokens = (torch.arange(16).reshape(2, 8) * 7 % 64).cuda()
    lm_loss(model(tokens), tokens).backward()
    expected = {name: p.grad.to_local().clone() for name, p in model.named_parameters()}
    model.zero_grad()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loss = lm_loss(model(tokens), tokens)
    torch.cuda.current_stream().wait_stream(side)
    assert _subclass_dispatches(loss.backward) == 1
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.to_local(), expected[name], msg=name)


def _mlps() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """An MLP compiled by fxshard, the same MLP unsharded, and an input."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model = fxshard.compile(copy.deepcopy(ref), backend="aot_eager")
    return model, ref, torch.randn(6, 4, generator=torch.Generator().manual_seed(1))


def _full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: None if p.grad is None else p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for name, p in model.named_parameters()}  # fmt: skip


def test_gradients_reach_grad_as_autograd_puts_them(no_dist):
    """fxshard sets and adds to ``.grad`` itself (see [Note: gradients into
    .grad without AccumulateGrad]): the same gradients as autograd's, set,
    added to, left alone by ``autograd.grad()``, given only to the
    ``inputs=`` of a backward, and to parameters with hooks through autograd."""
    model, ref, x = _mlps()
    for _ in range(2):  # set, then added to
        for m in (model, ref):
            m(x).pow(2).sum().backward()
    torch.testing.assert_close(_full_grads(model), _full_grads(ref))

    for m in (model, ref):
        m.zero_grad()
    shards = dict(model.named_parameters())
    grads = torch.autograd.grad(model(x).pow(2).sum(), list(shards.values()))
    expected = torch.autograd.grad(ref(x).pow(2).sum(), list(ref.parameters()))
    torch.testing.assert_close([g.full_tensor() for g in grads], list(expected))
    assert all(p.grad is None for p in shards.values()), "autograd.grad() set .grad"

    for m in (model, ref):
        m(x).pow(2).sum().backward(inputs=[m.get_parameter("2.weight")])
    got = _full_grads(model)
    assert [name for name, g in got.items() if g is not None] == ["2.weight"], got
    torch.testing.assert_close(got, _full_grads(ref))

    def double(p: torch.Tensor) -> None:
        p.grad.mul_(2)

    for m in (model, ref):
        m.zero_grad()
        m.get_parameter("0.weight").register_hook(lambda g: g * 3)
        m.get_parameter("0.bias").register_post_accumulate_grad_hook(double)
        m(x).pow(2).sum().backward()
    torch.testing.assert_close(_full_grads(model), _full_grads(ref))
