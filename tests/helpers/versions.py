"""The torch version the tests run under, for tests that document a torch
limitation (``xfail(strict=True)``, so that a fixed torch shows). The
library itself detects features, never versions (``runtime/compat``)."""

from __future__ import annotations

import torch

TORCH_BEFORE_2_13 = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)
