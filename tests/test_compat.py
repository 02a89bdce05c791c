"""The compatibility shims that change torch's behaviour, checked on the torch at hand."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import torch
import torch.fx as fx

from fxshard.runtime import compat
from fxshard.runtime.compat import tracing


def test_invoke_subgraph_schemas_are_built_once_per_body(monkeypatch):
    """Before torch 2.12 every invoke_subgraph call traced its body again for
    the op's schema (10 s of the 8B first step on torch 2.11). Inside
    fxshard's compiles the shim caches it per body graph and operand layout;
    symbolic or unknown operands, and callables that are not graphs, still
    build it each time. Outside them torch's own ``gen_schema`` runs."""
    traced = []

    class Hop:
        def gen_schema(self, subgraph, identifier, *operands):
            traced.append(identifier)
            return f"schema of {identifier} {len(operands)}"

    monkeypatch.setattr(tracing, "_torch_caches_subgraph_schemas", lambda: False)
    hop, body, other = Hop(), fx.GraphModule({}, fx.Graph()), fx.GraphModule({}, fx.Graph())
    x, y = torch.ones(2, 3), torch.ones(2, 3, requires_grad=True)
    original = Hop.gen_schema
    with compat.subgraph_schemas_cached(hop):
        with compat.subgraph_schemas_cached(hop):  # nested: wrapped once
            for _ in range(3):
                assert hop.gen_schema(body, "b", x, 4) == "schema of b 2"
        assert traced == ["b"]
        hop.gen_schema(body, "b", y, 4)  # another operand layout
        hop.gen_schema(other, "b", x, 4)  # another body
        hop.gen_schema(lambda *a: a, "f", x)  # not a graph
        hop.gen_schema(body, "b", x, object())  # an operand with no key
        assert traced == ["b", "b", "b", "f", "b"]
    assert Hop.gen_schema is original  # scoped: torch's own again
    hop.gen_schema(body, "b", x, 4)
    assert traced[-1] == "b" and len(traced) == 6


def test_invoke_subgraph_schemas_left_to_torch_where_it_caches(monkeypatch):
    class Hop:
        def gen_schema(self, subgraph, identifier, *operands):
            return None

    monkeypatch.setattr(tracing, "_torch_caches_subgraph_schemas", lambda: True)
    before = Hop.gen_schema
    with compat.subgraph_schemas_cached(Hop()):
        assert Hop.gen_schema is before


@torch.compiler.nested_compile_region
def _relu(x):
    return torch.relu(x)


def _sequential_relus(x, w1, w2, w3):
    return _relu(_relu(x @ w1) @ w2) @ w3


def test_outlined_bodies_do_not_write_into_the_callers_buffers():
    """A body's lowering inherited the outer backward's donated inputs, so the
    shared ReLU body's backward wrote its output into a buffer that the outer
    graph then reused (see [Note: subgraph donation]): wrong gradients."""
    import torch._inductor.config as inductor_config

    def backend(gm, example_inputs):
        return compat.compile_fx(gm, example_inputs, inner_compile=compat.compile_fx_inner)

    torch.manual_seed(0)
    args = [torch.randn(8, 32), torch.randn(32, 32), torch.randn(32, 32), torch.randn(32, 4)]
    args = [a.requires_grad_() for a in args]
    expected = torch.autograd.grad(_sequential_relus(*args).pow(2).mean(), args)
    torch._dynamo.reset()
    with inductor_config.patch(force_disable_caches=True):
        compiled = torch.compile(_sequential_relus, backend=backend, fullgraph=True)
        actual = torch.autograd.grad(compiled(*args).pow(2).mean(), args)
    torch._dynamo.reset()
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)


def test_torchs_error_about_logging_fxshards_config_is_dropped():
    """torch 2.11 cannot log the sets of functions that fxshard's calls put in
    dynamo's config with a compile's metrics, and says so at error level each
    compile; inside fxshard's calls that one error is dropped, others stay."""
    import logging

    log = logging.getLogger("torch._dynamo.metrics_context")

    def error(message: str) -> None:
        try:
            raise TypeError(message)
        except TypeError:
            log.exception("Unexpected exception logging compilation metrics")

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # torch's loggers do not propagate to pytest's
    log.addHandler(handler)
    try:
        with compat.debug_calls_in_traces():
            error("'<' not supported between instances of 'function' and 'function'")
            error("something else")
        error("'<' not supported between instances of 'function' and 'function'")
    finally:
        log.removeHandler(handler)
    messages = [str(r.exc_info[1]) for r in records]
    assert messages == ["something else", "'<' not supported between instances of 'function' and 'function'"]


def test_a_backward_that_raises_does_not_silence_later_ones():
    """The engine drops the end-of-backward callbacks of a backward that
    raises; the next backward that asks must queue its own (a flag left set
    by the failed one once dropped every later reduce)."""
    ran = []
    at_end = compat.AtBackwardEnd(lambda: ran.append(len(ran)))

    class Asks(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, fail):
            ctx.fail = fail
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            at_end.queue()
            at_end.queue()  # once per backward
            if ctx.fail:
                raise RuntimeError("on purpose")
            return grad, None

    x = torch.ones(2, requires_grad=True)
    Asks.apply(x, False).sum().backward()
    assert ran == [0] and not at_end.abandoned()
    try:
        Asks.apply(x, True).sum().backward()
    except RuntimeError:
        pass
    assert ran == [0]
    Asks.apply(x, False).sum().backward()
    assert ran == [0, 1]
    try:
        Asks.apply(x, True).sum().backward()
    except RuntimeError:
        pass
    assert not compat.in_backward() and at_end.abandoned() and not at_end.abandoned()


# What a compat module imports for its own annotations, never for callers.
_ANNOTATION_MODULES = ("__future__", "typing", "collections.abc")


def _public_names(module) -> set[str]:
    return {name for name, value in vars(module).items()
            if not name.startswith("_") and not inspect.ismodule(value)
            and getattr(value, "__module__", None) not in _ANNOTATION_MODULES}  # fmt: skip


def test_all_names_exactly_the_public_names_of_its_modules():
    """Each compat module's ``__all__`` is exactly the public names it
    defines or imports for callers, and ``compat.__all__`` is all of them,
    each once: a public name added to a module without listing it, a module
    not re-exported, or a name listed after it is gone fails here."""
    modules = [importlib.import_module(f"{compat.__name__}.{m.name}") for m in pkgutil.iter_modules(compat.__path__)]
    listed = [name for module in modules for name in module.__all__]
    assert len(listed) == len(set(listed)), sorted(n for n in listed if listed.count(n) > 1)
    assert sorted(compat.__all__) == sorted(listed)
    for module in [compat, *modules]:
        assert _public_names(module) == set(module.__all__), module.__name__


def test_a_size_that_depends_on_data_has_a_hint_on_every_torch(monkeypatch):
    """The tokens an expert-parallel all-to-all receives are unbacked sizes.
    torch 2.11's hint_int raises on them (and the peak estimate failed on the
    GPU machines); each unbacked symbol counts as Inductor's fallback, as
    torch 2.13's optimization_hint counts it."""
    from torch._inductor import config
    from torch.fx.experimental import symbolic_shapes

    env = symbolic_shapes.ShapeEnv()
    u0, u1 = env.create_unbacked_symint(), env.create_unbacked_symint()
    expected = 1024 * 2 * config.unbacked_symint_fallback
    assert compat.size_hint(1024 * (u0 + u1)) == expected

    def raises(value, fallback=None):  # torch 2.11's hint_int on an unbacked size
        raise symbolic_shapes.GuardOnDataDependentSymNode(f"data-dependent expression {value}")

    monkeypatch.setattr(symbolic_shapes, "optimization_hint", raises, raising=False)
    assert compat.size_hint(1024 * (u0 + u1)) == expected
    assert compat.size_hint(7) == 7
