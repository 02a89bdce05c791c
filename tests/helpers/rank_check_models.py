"""Models for tests/test_rank_checks.py, outside the test module: pytest
rewrites a test module's ``assert`` statements, which dynamo cannot trace."""

from __future__ import annotations

import logging
import warnings

import torch
import torch.nn as nn

log = logging.getLogger("tests.rank_checks")


class Branchy(nn.Module):
    """Reads ``a`` only for sequences longer than 8: which parameters a graph
    gathers depends on the input's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 8:
            x = torch.relu(self.a(x))
        return self.b(x)


class Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise KeyError("boom")
        assert x.shape[0] != 5, "batch of 5"
        return self.lin(x)


class Chatty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log.warning("forward of %s", "Chatty")
        warnings.warn("Chatty warns")  # noqa: B028 (a user's plain warn, as the test needs)
        print("Chatty prints", x)
        return self.lin(x)


class ChattyOnce(nn.Module):
    """Logs through ``warning_once``, which transformers adds to
    ``logging.Logger`` when imported and calls inside models' losses (GPT-2's)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log.warning_once("forward of %s", "ChattyOnce")
        return self.lin(x)
