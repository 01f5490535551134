"""The summary's long-context section and its chart (long_context.png): the rows `long_context` writes, rendered."""

from __future__ import annotations

from .long_context import (
    CURVE_STUDY,
    DEVICE_BYTES,
    SETUP_STUDY,
    SETUPS,
    SP_STEP_SEQ,
    SP_STEP_STUDY,
    STATES_MIXED,
    LongestRow,
    fit_length,
)
from .markdown import human_bytes, table
from .rows import LONGEST_STUDY, Row

INTRO = (
    "Longest trainable sequence (**counted**, `scripts/bench/long_context.py`; how: `docs/bench.md`): one device's "
    "peak memory over a training step at batch 1, bfloat16, every decoder layer checkpointed, ZeRO-3 over the devices "
    "as DeepSpeed 0.19 keeps it under bf16 (bf16 parameters and gradients, float32 master weights and AdamW moments: "
    "16 bytes a parameter, 1/N each; its 1 GB gradient bucket; the optimizer's float32 gradient one sub-group at a "
    "time), counted on fake tensors at 2 and 3 layers and carried to the model's; the all-to-all of Ulysses SP and "
    "ZeRO-3's gathers are modelled. The longest length is "
    "the longest counted at most {limit} (an Atlas A2 device, no allowance for the runtime or the allocator); the "
    "next length counted (at least 1% longer) does not fit. Without SP each device trains a sequence of its own; with "
    "SP the devices share one. Checkpoint offload: the checkpointed hidden states on the host; optimizer offload: "
    "ZeRO-Offload (float32 master, moments, gradient partition and the step on the host, bf16 parameters on the "
    "device); bf16 master and moments: DeepSpeed's `bf16_master_weights_and_grads` and `bf16_optimizer_states` (8 "
    "bytes a parameter), shown beside, not read by the targets."
)


def _tokens(n: float | None) -> str:
    if n is None:
        return "-"
    return "none" if not n else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}k"


def long_context_section(rows: list[Row]) -> list[str]:
    """Render the summary's long-context section.

    The longest sequence per model and device count (eager, peer, ours with SP), every setup's with its bound, and
    the SP step's estimated time by category at `SP_STEP_SEQ` tokens with its all-to-all volume per layer."""
    setups = [LongestRow.of(r) for r in rows if r.study == SETUP_STUDY]
    if not setups:
        return []
    lines = ["", INTRO.format(limit=human_bytes(DEVICE_BYTES)), ""]
    summary = [r for r in rows if r.study == LONGEST_STUDY]
    peer = any(r.peer is not None for r in summary)
    body = [
        [r.model, r.path, _tokens(r.eager), *([_tokens(r.peer)] if peer else []), _tokens(r.kernelized), r.variant,
         f"{r.kernelized / r.eager:.1f} x" if r.eager else "-"]
        for r in summary
    ]  # fmt: skip
    header = ["model", "devices", "eager HF", *(["peer"] if peer else []), "ours + SP", "reached by", "ours / eager"]
    lines += table(header, body)
    body = [
        [r.model, r.setup, str(r.devices), _tokens(r.seq), human_bytes(r.peak) if r.seq else "-", r.bound, r.parts,
         f"{_tokens(r.exceeds_seq)}: {human_bytes(r.exceeds_peak)}" if r.exceeds_seq else "-",
         _tokens(memory_alone(r, rows)) if r.seq else "-"]
        for r in setups
    ]  # fmt: skip
    header = ["model", "setup", "devices", "longest", "peak", "bound", "at the peak", "next counted", "memory alone"]
    lines += [
        "",
        "Every setup: the longest length, its peak, what bounds it (the part of the peak that grows most to the next "
        "length counted, which does not fit) and the parts at the peak; memory alone: the length at which the line "
        "through the two longest counted lengths that fit reaches the device's memory, a fit, not a count (it "
        "differs from the longest where something else binds, as the attention op's 2^20 tokens per call):",
        "",
        *table(header, body),
    ]
    return lines + _sp_step_table(rows)


def memory_alone(row: LongestRow, rows: list[Row]) -> int | None:
    """What memory alone would allow the setup: a fit, for where something else bounds it (None: too few counts).

    The length at which the line through the setup's two longest counted lengths that fit reaches the device's
    memory."""
    points = sorted(
        (r.seq, r.kernelized)
        for r in rows
        if r.study == CURVE_STUDY
        and (r.model, r.variant, r.path) == (row.model, row.setup, str(row.devices))
        and r.kernelized <= DEVICE_BYTES
    )
    if len(points) < 2:
        return None
    (x0, y0), (x1, y1) = points[-2:]
    return fit_length([(x0, y0), ((x0 + x1) / 2, (y0 + y1) / 2), (x1, y1)], DEVICE_BYTES)


def _sp_step_table(rows: list[Row]) -> list[str]:
    chosen = [r for r in rows if r.study == SP_STEP_STUDY]
    if not chosen:
        return []
    models = list(dict.fromkeys(r.model for r in chosen))
    split = [r.op for r in chosen if r.unit == "ms" and not r.op.startswith("estimated")]
    split = list(dict.fromkeys(split))
    body = []
    for model in models:
        mine = {r.op: r for r in chosen if r.model == model}
        step = next(r for r in chosen if r.model == model and r.op.startswith("estimated"))
        volume = next(r for r in chosen if r.model == model and r.unit == "bytes")
        cells = [_ms(mine[c].kernelized) for c in split]
        body.append([model, *cells, _ms(step.kernelized), human_bytes(volume.kernelized)])
    title = (
        f"Ours + Ulysses SP 8 + tiled MLP at {_tokens(SP_STEP_SEQ)} tokens over 8 devices: one rank's step by category "
        "(**estimate**, Atlas A2 model, docs/step-model.md; the recomputed forwards of checkpointing and tiling "
        "included; communication not modelled) and the all-to-all bytes one rank sends per decoder layer (counted "
        "from the tensors it sends: q, k, v and the output forward, their gradients backward):"
    )
    header = ["model", *split, "estimated step", "all-to-all per layer"]
    return ["", title, "", *table(header, body)]


def _ms(value: float) -> str:
    return f"{value / 1e3:.2f} s" if value >= 1e3 else f"{value:.1f} ms"


def write_long_context_chart(rows: list[Row], path) -> str | None:
    """Draw long_context.png: per model, one device's counted peak against the sequence length per setup.

    On 8 devices, with the device's memory as a line. None when drawn or nothing to draw; else why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no long_context.png: matplotlib is not installed"
    curve = [r for r in rows if r.study == CURVE_STUDY and r.path == "8"]
    if not curve:
        return None
    models = list(dict.fromkeys(r.model for r in curve))
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 6.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for setup in SETUPS:
            style = ":" if setup.variant == "peer" else "-." if setup.states is not STATES_MIXED else "-"
            points = sorted((r.seq, r.kernelized) for r in curve if r.model == model and r.variant == setup.name)
            if points:
                xs, ys = [p[0] for p in points], [p[1] / 1e9 for p in points]
                ax.plot(xs, ys, marker="o", linestyle=style, label=setup.name)
        ax.axhline(DEVICE_BYTES / 1e9, color="black", linestyle="--", label=f"{DEVICE_BYTES / 1e9:.0f} GB device")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_ylim(top=4 * DEVICE_BYTES / 1e9)  # beyond: lengths far past what fits (S x S scores), off the chart
        ax.set_xlabel("sequence length, tokens (over the SP group)")
        ax.set_ylabel("peak per device, GB (counted)")
        ax.set_title(f"{model} on 8 devices, ZeRO-3, checkpointed", fontsize=10)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
