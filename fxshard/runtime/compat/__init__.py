"""Every private torch API fxshard touches, behind feature detection.

fxshard supports torch >= 2.11. Nothing outside this package imports from a
private torch namespace (``torch._*``); when an upstream name moves, this is
the one place to change. Where torch versions differ, a name is detected
(the newer one, then the older) rather than chosen by version number.

One module per torch subsystem:

- ``dynamo``: graph breaks and user errors of a fullgraph compile, logging
  calls in traces, frames dynamo must not compile on their own;
- ``tracing``: AOTAutograd, ``make_fx``, symbolic sizes, ``invoke_subgraph``;
- ``inductor``: ``compile_fx``, its config, decompositions and caches;
- ``autograd``: the engine's backward passes and their end;
- ``tensors``: DTensor internals, parameters and foreach paths, private ops;
- ``distributed``: process groups, stores, meshes, async collectives;
- ``cuda``: what captured steps need (capture streams, sync debug mode).

Code outside the package calls ``compat.<name>``: every module's names are
re-exported here, so a test that patches ``compat.<name>`` reaches those
calls. A call between functions of one module looks the name up in that
module; patch it there.
"""

from __future__ import annotations

import torch

if tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 11):
    raise ImportError(f"fxshard needs torch >= 2.11, found {torch.__version__}")

from fxshard.runtime.compat import autograd, cuda, distributed, dynamo, inductor, tensors, tracing  # noqa: E402
from fxshard.runtime.compat.autograd import *  # noqa: E402, F403
from fxshard.runtime.compat.cuda import *  # noqa: E402, F403
from fxshard.runtime.compat.distributed import *  # noqa: E402, F403
from fxshard.runtime.compat.dynamo import *  # noqa: E402, F403
from fxshard.runtime.compat.inductor import *  # noqa: E402, F403
from fxshard.runtime.compat.tensors import *  # noqa: E402, F403
from fxshard.runtime.compat.tracing import *  # noqa: E402, F403

__all__: list[str] = []
__all__ += autograd.__all__
__all__ += cuda.__all__
__all__ += distributed.__all__
__all__ += dynamo.__all__
__all__ += inductor.__all__
__all__ += tensors.__all__
__all__ += tracing.__all__
