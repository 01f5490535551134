"""The summary's training-step section (the tables of every step study) and the step chart, step.png.

It renders the rows `step_study` and `step_validation` write to bench.csv, read back from them.
"""

from __future__ import annotations

from .device_model import HOST_PER_OP
from .markdown import human_bytes, table
from .rows import ESTIMATE_STUDY, MIXED_PRECISION_STUDY, Row
from .step import (
    DECODE_STUDY,
    LARGEST_OTHER_OPS,
    OTHER,
    OTHER_OPS_STUDY,
    STEP_STUDY,
    UNTOUCHED,
    VALIDATION_STUDY,
    categories,
)
from .step_study import UNITS, CategoryRow, MixedPrecisionRow, OtherOpRow, category_rows
from .step_validation import ValidationRow


def _mixed_precision_table(rows: list[MixedPrecisionRow], peer: bool) -> list[str]:
    if not rows:
        return []
    body = [
        [r.model, "estimated step time (**estimate**)" if r.unit == "ms" else r.unit, _cell(r.eager, r.unit),
         _cell(r.kernelized, r.unit), *([_cell(r.peer, r.unit)] if peer else []), f"{r.kernelized / r.eager:.3f}"]
        for r in rows
    ]  # fmt: skip
    title = (
        "The training step as Trainer's `bf16=True` runs it (float32 weights, gradients and AdamW state; forward under "
        "`torch.autocast` bfloat16, so each matmul casts its weight on every call and sdpa its q, k and v), batch "
        f"{rows[0].batch} x sequence {rows[0].seq}, derived as the step above:"
    )
    header = ["model", "figure", "eager", "ours", *(["peer"] if peer else []), "ours / eager"]
    return ["", title, "", *table(header, body)]


def _cell(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("bytes", "peak bytes", "saved bytes"):
        return human_bytes(value)
    if unit == "FLOPs":
        return f"{value / 1e15:.2f} PFLOP"
    if unit == "ms":
        return f"{value / 1e3:.2f} s" if value >= 1e3 else f"{value:.2f} ms"
    return f"{value:.0f}"


def step_section(rows: list[Row]) -> list[str]:
    """Render the summary's training-step section.

    It holds the counted step per model, its estimated time, the bytes by category, the time model's validation against
    published figures, the decode-step estimate and the step under Trainer's mixed precision."""
    counted = [r for r in rows if r.study == STEP_STUDY]
    if not counted:
        return []
    peer = any(r.peer is not None for r in counted)
    variants = ["eager", "ours", *(["peer"] if peer else [])]
    by = {(r.model, r.unit): r for r in counted}
    estimates = {r.model: r for r in rows if r.study == ESTIMATE_STUDY}
    models = list(dict.fromkeys(r.model for r in counted))
    body = []
    for model in models:
        for unit in (*UNITS.values(), "ms"):
            r = by.get((model, unit)) if unit != "ms" else estimates.get(model)
            if r is None:
                continue
            label = "estimated step time (**estimate**, Atlas A2 model)" if unit == "ms" else unit
            values = [r.eager, r.kernelized, *([r.peer] if peer else [])]
            ours = f"{r.kernelized / r.eager:.2f}" if r.eager else "-"
            body.append([model, label, *(_cell(v, unit) for v in values), ours])
    first = counted[0]
    title = (
        f"Counted training step, batch {first.batch} x sequence {first.seq}, bfloat16: embedding, every decoder layer, "
        "final norm, LM head and loss, backward, AdamW(foreach) step (ours: the default path, kernelize alone). "
        "Ops, bytes and FLOPs derived exactly from the model measured whole at 2 and 3 layers "
        "(`scripts/bench/step.py`); peak memory includes the bfloat16 parameters, AdamW's two moments (bfloat16) "
        "and the gradients. The "
        "estimated time is a model, not a measurement (`docs/step-model.md`); it is shown in the step chart "
        "(step.png):"
    )
    lines = ["", title, "", *table(["model", "figure", *variants, "ours / eager"], body)]
    lines += _category_table(category_rows(rows, "bytes"), models)
    lines += _time_table(category_rows(rows, "ms"), rows, models)
    lines += _other_ops_table([OtherOpRow.of(r) for r in rows if r.study == OTHER_OPS_STUDY], peer)
    lines += _validation_table([ValidationRow.of(r) for r in rows if r.study == VALIDATION_STUDY])
    lines += _decode_table(rows, peer)
    mixed = [MixedPrecisionRow.of(r) for r in rows if r.study == MIXED_PRECISION_STUDY]
    lines += _mixed_precision_table(mixed, peer)
    return lines


def _variant_categories(chosen: list[CategoryRow], models: list[str]):
    """(model, variant, its CategoryRow field, {category: value}) for each model's variant with every category."""
    for model in models:
        for variant, attr in (("eager", "eager"), ("ours", "kernelized"), ("peer", "peer")):
            values = {r.category: getattr(r, attr) for r in chosen if r.model == model}
            if values and all(v is not None for v in values.values()):
                yield model, variant, attr, values


def _category_table(chosen: list[CategoryRow], models: list[str]) -> list[str]:
    if not chosen:
        return []
    body = []
    for model, variant, _, values in _variant_categories(chosen, models):
        total = sum(values.values())
        untouched = sum(values[c] for c in UNTOUCHED) / total
        shares = (f"{values[c] / total:.0%}" for c in categories())
        body.append([model, variant, *shares, f"**{untouched:.0%}**"])
    title = (
        "Where the step's bytes go, by op (counted; share of each step's bytes). The first four are what no card "
        "touches: the next fusion target is the largest share there, or the 'other' ops the cards leave:"
    )
    return ["", title, "", *table(["model", "variant", *categories(), "no card touches"], body)]


def _time_table(chosen: list[CategoryRow], rows: list[Row], models: list[str]) -> list[str]:
    """Where the step's estimated time goes: per model and variant, the device seconds of each category."""
    estimates = {r.model: r for r in rows if r.study == ESTIMATE_STUDY}
    if not chosen:
        return []
    body = []
    for model, variant, attr, values in _variant_categories(chosen, models):
        step = getattr(estimates[model], attr) if model in estimates else None
        cells = (_cell(values[c], "ms") for c in categories())
        body.append([model, variant, *cells, _cell(sum(values.values()), "ms"), _cell(step, "ms")])
    title = (
        "Where the step's estimated time goes, by op (**estimate**, Atlas A2 model: each op's device time, "
        "summed by category; the step is the device's sum or the host's per-op cost, whichever is longer):"
    )
    header = ["model", "variant", *categories(), "device", "estimated step"]
    return ["", title, "", *table(header, body)]


def _other_ops_table(chosen: list[OtherOpRow], peer: bool) -> list[str]:
    """The largest ops of the 'other' category, by our estimated time, per model: where the next fusion would pay."""
    if not chosen:
        return []
    body = [
        [r.model, r.aten_op, _cell(r.eager, "ms"), _cell(r.kernelized, "ms"), *([_cell(r.peer, "ms")] if peer else [])]
        for r in chosen
    ]
    title = (
        f"The {LARGEST_OTHER_OPS} largest aten ops of the '{OTHER}' category in our step, per model (**estimate**: "
        "device time of every call of the op over the step; the next fusion to make is among them):"
    )
    return ["", title, "", *table(["model", "aten op", "eager", "ours", *(["peer"] if peer else [])], body)]


def _validation_table(rows: list[ValidationRow]) -> list[str]:
    if not rows:
        return []
    body = [
        [
            r.source,
            r.claim,
            r.model,
            f"{r.batch} x {r.seq}",
            f"{r.published:.3g}",
            f"{r.predicted:.3g}",
            r.error,
            r.assumptions,
        ]
        for r in rows
    ]
    title = (
        "The time model checked against published step-level figures (same model and fusion; the batch the source "
        "gives, else the stated assumption); prediction from the model's constants only, nothing fitted to these "
        "figures. Units: throughput and step time in %, ratio eager / fused, peak memory saved in GB:"
    )
    header = ["source", "published claim", "model", "batch x seq", "published", "predicted", "error", "assumptions"]
    return ["", title, "", *table(header, body)]


def _decode_table(rows: list[Row], peer: bool) -> list[str]:
    chosen = [r for r in rows if r.study == DECODE_STUDY]
    if not chosen:
        return []
    body = [
        [r.model, _cell(r.eager, "ms"), _cell(r.kernelized, "ms"), *([_cell(r.peer, "ms")] if peer else []), r.note]
        for r in chosen
    ]
    title = (
        "Estimated decode step (one token, batch 1, forward in inference mode, no KV cache), **estimate**: the host "
        f"issues every op at {HOST_PER_OP.value * 1e6:.1f} us (device_model.HOST_PER_OP), so the op count, not the "
        "bytes, bounds it:"
    )
    header = ["model", "eager", "ours", *(["peer"] if peer else []), "ops and where the time goes"]
    return ["", title, "", *table(header, body)]


def write_step_chart(rows: list[Row], path) -> str | None:
    """step.png: per model, the estimated step time split by category, eager vs ours vs the peer (an estimate)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no step.png: matplotlib is not installed"
    chosen = category_rows(rows, "ms")
    if not chosen:
        return None
    models = list(dict.fromkeys(r.model for r in chosen))
    variants = [("eager", "eager"), ("ours", "kernelized"), ("peer", "peer")]
    variants = [v for v in variants if all(getattr(r, v[1]) is not None for r in chosen)]
    fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        bottoms = [0.0] * len(variants)
        colors = plt.get_cmap("tab20").colors
        for i, kind in enumerate(categories()):
            r = next(r for r in chosen if r.model == model and r.category == kind)
            values = [getattr(r, attr) / 1e3 for _, attr in variants]
            ax.bar([v for v, _ in variants], values, bottom=bottoms, color=colors[i % len(colors)], label=kind)
            bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
        for x, total in enumerate(bottoms):
            ax.text(x, total, f"{total:.2f} s", ha="center", va="bottom", fontsize=8)
        ax.set_title(model, fontsize=10)
        ax.set_ylabel("estimated device time per step, s (estimate)")
    fig.legend(*axes[0][0].get_legend_handles_labels(), fontsize=7, loc="center right")  # beside the bars
    first = chosen[0]
    fig.suptitle(
        f"Training step, batch {first.batch} x seq {first.seq}: estimated Atlas A2 device time by category "
        "(an estimate from counted bytes and FLOPs, docs/step-model.md)",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return None
