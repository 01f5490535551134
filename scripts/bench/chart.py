"""Draws bench.png, the bench's chart.

It shows the decoder layer's ops, bytes per region against the floor, the experts sweep, the host-side targets, and the
decoder layer's memory (saved for backward and peak)."""

from __future__ import annotations

from pathlib import Path

from npu_hub_kernels.cards import Card

from .cards import LAYER, NO_CARD, ExpertsSweep, kinds, with_piece
from .configs import CONFIGS
from .markdown import human_bytes
from .rows import MEMORY_UNITS, REGION_STUDIES, Row, largest_shape, sweep_ops
from .targets import counted_targets
from .timed import FALLBACK_TOLERANCE, KERNELIZE_TARGET_MS, OVERHEAD_STUDY, OVERHEAD_TARGET_US, CallOverheadRow


def write_chart(rows: list[Row], path: Path, machine: str) -> str | None:
    """Draw bench.png; returns why no chart was drawn, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no bench.png: matplotlib is not installed (it is a dev requirement: requirements-dev.txt)"
    fig, axes = plt.subplots(3, 2, figsize=(16, 15))
    _chart_layer_ops(axes[0][0], rows)
    _chart_bytes(axes[0][1], rows)
    sweeps = with_piece("EXPERTS_SWEEP")
    if sweeps:  # the first card with an experts sweep (one panel)
        _chart_sweep(axes[1][0], rows, *sweeps[0])
    else:
        _not_run(axes[1][0], "Experts sweep")
    _chart_host(axes[1][1], rows)
    for ax, unit in zip(axes[2], MEMORY_UNITS, strict=True):
        _chart_layer_memory(ax, rows, unit)
    fig.suptitle(f"npu-hub-kernels: counted on fake tensors (emulated torch_npu), timed on {machine}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None


def _not_run(ax, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _chart_layer_ops(ax, rows: list[Row]) -> None:
    title = "Device ops of one decoder layer, fwd+bwd (log scale)"
    layers = [r for r in rows if r.study == "layer" and r.kind == LAYER and r.unit == "ops" and r.phase == "fwd+bwd"]
    layers = list({r.model: r for r in layers}.values())
    if not layers:
        return _not_run(ax, title)
    _variant_bars(ax, layers, lambda value: f"{value:.0f}")
    ax.set_yscale("log")
    ax.set_ylabel("device ops")
    ax.set_title(title)


def _variant_bars(ax, layers: list[Row], text, scale: float = 1.0) -> None:
    """Draw one group of bars per model.

    The bars are eager, kernelized, the peer's (when measured) and the floor, each drawn divided by `scale` and labelled
    by `text` of its value."""
    series = [
        ("eager transformers", [r.eager for r in layers]),
        ("kernelized (default path: kernelize only)", [r.kernelized for r in layers]),
        ("peer: LLaMA-Factory NPU kernels", [r.peer for r in layers]),
        ("floor", [r.floor for r in layers]),
    ]
    series = [(label, values) for label, values in series if None not in values]
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        xs = [x - 0.4 + (i + 0.5) * width for x in range(len(layers))]
        bars = ax.bar(xs, [v / scale for v in values], width, label=label)
        ax.bar_label(bars, [text(v) for v in values], fontsize=7)
    ax.set_xticks(range(len(layers)), [r.model for r in layers])
    ax.legend(fontsize=8)


def _chart_layer_memory(ax, rows: list[Row], unit: str) -> None:
    """The decoder layer's saved or peak bytes, fwd+bwd, at the largest shape."""
    what = "bytes kept for backward" if unit == MEMORY_UNITS[0] else "peak live bytes (floor: derived)"
    layers = [r for r in rows if r.study == "layer" and r.kind == LAYER and r.unit == unit]
    if not layers:
        return _not_run(ax, f"Decoder layer memory: {what}")
    batch, seq = largest_shape(layers)
    layers = [r for r in layers if (r.batch, r.seq) == (batch, seq)]
    _variant_bars(ax, layers, human_bytes, scale=1e9)
    ax.set_ylabel("GB")
    ax.set_title(f"Decoder layer, {what}, fwd+bwd, batch {batch} x seq {seq}")


def _chart_bytes(ax, rows: list[Row]) -> None:
    counted = [r for r in rows if r.study in REGION_STUDIES and r.unit == "bytes" and r.phase == "fwd+bwd"]
    shown = [k for k in (*kinds(), LAYER) if any(r.kind == k for r in counted)]
    if not shown:
        return _not_run(ax, "Bytes moved / floor")
    batch, seq = largest_shape(counted)
    chosen = [r for r in counted if (r.batch, r.seq) == (batch, seq)]
    models = list(dict.fromkeys(r.model for r in chosen))
    width = 0.8 / len(models)
    peer_label = {"x": "peer (LLaMA-Factory)", "1": "peer: not patched (eager)"}
    for i, model in enumerate(models):
        label = model
        for j, kind in enumerate(shown):
            row = next((r for r in chosen if (r.model, r.kind) == (model, kind)), None)
            if row is None:
                continue
            x = j - 0.4 + (i + 0.5) * width
            ax.bar(x, row.eager / row.floor, width, color=f"C{i}", alpha=0.3)
            if row.kernelized is None:
                ax.text(x, 1, NO_CARD, rotation=90, ha="center", va="bottom", fontsize=7)
            else:
                ax.bar(x, row.ratio, width * 0.6, color=f"C{i}", label=label)
                label = None
            if row.peer is not None:
                marker = "x" if row.peer_patched is not False else "1"
                ax.plot(x, row.peer / row.floor, marker, color="k", markersize=8, label=peer_label[marker])
                peer_label[marker] = None
    label = "target (x floor)"
    for j, kind in enumerate(shown):
        bound = next((t.bound for t in counted_targets() if (t.kind, t.unit) == (kind, "bytes")), None)
        if bound is not None:
            ax.hlines(bound, j - 0.45, j + 0.45, color="k", linestyle="--", linewidth=0.8, label=label)
            label = None
    ax.axhline(1.0, color="k", linewidth=0.6, label="floor")
    ax.set_xticks(range(len(shown)), shown)
    ax.set_yscale("log")
    ax.set_ylim(0.5, max(r.eager / r.floor for r in chosen) * 20)  # kernelized bars visible; the legend above
    ax.set_ylabel("bytes / floor (pale: eager, solid: kernelized, x: peer)")
    ax.set_title(f"Bytes / floor per region and layer, fwd+bwd, batch {batch} x seq {seq} (log scale)")
    ax.legend(fontsize=7, ncol=3, loc="upper left")


def _chart_sweep(ax, rows: list[Row], card: Card, sweep_spec: ExpertsSweep) -> None:
    """The experts sweep of the card's region (its spec's EXPERTS_SWEEP): ops by number of experts."""
    sweep = sweep_ops(rows, card.region)
    model = CONFIGS[sweep_spec.model].name
    title = f"{card.region} ({model} layer, top-8): ops by number of experts, fwd+bwd"
    if not sweep:
        return _not_run(ax, title)
    loop = [r for r in sweep if r.implementation == "eager"]
    grouped = [r for r in sweep if r.implementation == "grouped_mm"]
    experts = [r.experts for r in loop]
    ax.plot(experts, [r.eager for r in loop], "o-", label="transformers eager loop")
    ax.plot(experts, [r.eager for r in grouped], "s-", label="transformers grouped_mm")
    if all(r.kernelized is not None for r in loop):
        ax.plot(experts, [r.kernelized for r in loop], "^-", label=card.repo_name)
    else:
        ax.text(0.5, 0.1, f"{card.repo_name}: {NO_CARD}", transform=ax.transAxes, ha="center")
    if all(r.peer is not None for r in loop):
        ax.plot(experts, [r.peer for r in loop], "x-", label="peer: LLaMA-Factory")
    ax.plot(experts, [r.floor for r in loop], "k--", label="floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("experts")
    ax.set_ylabel("device ops")
    ax.set_title(title)
    ax.legend(fontsize=8)


def _chart_host(ax, rows: list[Row]) -> None:
    title = "Host side, measured / target (left of the dashed line: target met)"
    bars = []
    for r in rows:
        if r.mode != "timed" or r.emulated:
            continue
        if r.study == "kernelize":
            bars.append((f"kernelize, 32 layers: {r.kernelized:.1f} ms", r.kernelized / KERNELIZE_TARGET_MS))
        elif r.study == OVERHEAD_STUDY:
            us = CallOverheadRow.of(r).overhead_us
            bars.append((f"{r.kind} module call overhead: {us:.2f} us", max(us, 0) / OVERHEAD_TARGET_US))
        elif r.study == "fallback":
            bars.append((f"{r.kind} fallback: {r.ratio:.2f} x eager", r.ratio / FALLBACK_TOLERANCE))
    if not bars:
        return _not_run(ax, title)
    ax.barh(range(len(bars)), [v for _, v in bars], color=["C2" if v <= 1 else "C3" for _, v in bars])
    ax.set_yticks(range(len(bars)), [label for label, _ in bars], fontsize=8)
    ax.axvline(1.0, color="k", linestyle="--", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_title(title)
