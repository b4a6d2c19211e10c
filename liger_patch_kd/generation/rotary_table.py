"""A decode session's rotary tables: cos and sin of every position of its cache, computed once by the model's own
rotary module and looked up at each step.

A transformers rotary module computes cos / sin from the position ids at every forward: the positions to float,
their product with the inverse frequencies, a concatenation, cos, sin and two scalings, seven kernels of a decode
step that on a small model is bound by how many kernels it launches. Where the inverse frequencies never change
with the length (STATIC_ROPE_TYPES; "dynamic" and "longrope" rescale them past a length), position p's cos / sin
are the same whatever else is in the batch, so one table over the session's positions, made by the module's own
forward, holds exactly what each step would compute, and a step reads it with one gather.

The table is made at the session's first forward (its prefill, eager) in that forward's dtype, and checked there
against the module's own output for the prefill's positions: a module that computes anything else (3-D position
ids, a per-layer argument, a forward of its own kind) keeps its forward. It is computed again, in place (a captured
step reads its storage), at the start of every decode call, as the session's projection copies are: inverse
frequencies changed in place since the last call are what the next call rotates by. Only the session's twin
(kernel_twin.py) gets a table; the user's module is never touched.
"""

from __future__ import annotations

import torch
from torch import nn

STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class RotaryTable:
    """cos / sin of positions [0, length) of `module` (a transformers *RotaryEmbedding), stacked as (2, length, D)
    per dtype, standing in for its forward."""

    def __init__(self, module: nn.Module, length: int) -> None:
        self.own_forward = module.forward  # the module's bound forward (decorators included)
        self.length = length
        self.tables: dict[torch.dtype, torch.Tensor] = {}
        self.probes: dict[torch.dtype, torch.Tensor] = {}  # one position of the first forward's input, per dtype
        self.refused = False  # the check at the first forward found other values: the module's forward from then on

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, *args, **kwargs):
        if self.refused or args or kwargs or position_ids.dim() != 2:
            return self.own_forward(x, position_ids, *args, **kwargs)
        table = self.tables.get(x.dtype)
        if table is None:  # the first forward of this dtype: eager (a prefill), never inside a capture
            table = self._make(x, position_ids)
            if table is None:
                return self.own_forward(x, position_ids)
        both = table[:, position_ids]  # (2, rows, T, D): one gather
        return both[0], both[1]

    def refresh(self) -> None:
        """Every table computed again by the module, into its own storage."""
        for dtype, table in self.tables.items():
            cos, sin = self._computed(self.probes[dtype])
            table[0].copy_(cos[0])
            table[1].copy_(sin[0])

    def _computed(self, probe: torch.Tensor):
        return self.own_forward(probe, torch.arange(self.length, device=probe.device)[None])

    def _make(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor | None:
        probe = x[:1, :1].detach().clone()
        cos, sin = self._computed(probe)
        table = torch.stack([cos[0], sin[0]])
        want = self.own_forward(x, position_ids)
        got = table[:, position_ids]
        if not all(w.shape == g.shape and w.dtype == g.dtype and torch.equal(w, g) for w, g in zip(want, got)):
            self.refused = True
            return None
        self.tables[x.dtype], self.probes[x.dtype] = table, probe
        return table


def install_rotary_tables(twin: nn.Module, length: int) -> list[RotaryTable]:
    """Give each rotary module of `twin` whose frequencies do not follow the length a table of `length` positions
    (its forward replaced on the twin's own instance); returns the tables (refresh them at each call)."""
    tables = []
    for module in twin.modules():
        if not type(module).__name__.endswith("RotaryEmbedding") or "forward" in module.__dict__:
            continue
        rope_type = getattr(module, "rope_type", None)  # a dict per layer type in some models (Gemma-3): no table
        if not isinstance(rope_type, str) or rope_type not in STATIC_ROPE_TYPES:
            continue
        tables.append(RotaryTable(module, length))
        module.forward = tables[-1].forward
    return tables
