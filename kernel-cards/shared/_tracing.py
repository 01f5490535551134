"""Whether torch.compile, torch.export or torch.jit.trace is tracing the call (copied into the cards that list it).

Each traces a call's Python once into a graph. A fused path that reads a value on the host (the per-expert token
counts, the labels' range) or sets an attribute for the length of a call is no graph: torch.export refuses the
data-dependent size, torch.compile breaks its graph there or fails inside the op, and torch.jit.trace keeps the traced
call's values as constants (another batch's padding would be read as the traced one's). A card whose fused path does so
asks `graph_tracer` in its `<op>_unavailable_reason`, and runs its eager path under a tracer, saying so.
"""

from __future__ import annotations

import torch


def graph_tracer() -> str | None:
    """The tracer recording this call into a graph ("torch.export", "torch.compile or torch.export", ...), or None.

    torch.export's default (non-strict) form says it exports (`torch.compiler.is_exporting`); torch.compile and
    torch.export's strict form both trace with dynamo, which says only that it compiles (`is_compiling`);
    torch.jit.trace says it traces (`torch.jit.is_tracing`)."""
    if torch.jit.is_tracing():
        return "torch.jit.trace"
    if not torch.compiler.is_compiling():
        return None
    return "torch.export" if torch.compiler.is_exporting() else "torch.compile or torch.export"
