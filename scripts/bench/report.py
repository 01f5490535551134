"""The markdown the bench writes: summary.md, the tables page, the README's short section, each card's benchmark.md.

summary.md holds every table; the tables page (docs/benchmarks.md) is summary.md with the charts.

The README section is the one between the bench markers: the targets met and missed, the step chart and a link to the
tables page. One table renderer (`markdown.table`), and one renderer of the counted table (`counted_table`) for the
summary and the cards.
"""

from __future__ import annotations

from pathlib import Path

from npu_hub_kernels.cards import Card

from .attention import attention_section
from .cards import NO_CARD, OutsideRegion, card_named, spec, with_piece
from .configs import PREFILL_DECODE
from .long_context_report import long_context_section
from .markdown import human_bytes, number, table
from .padding_free import padding_free_section
from .peer import OUTCOMES, PARITY_STUDY, PARITY_TOLERANCE, ParityRow
from .rows import (
    ATTENTION_STUDY,
    CHUNK_STUDY,
    ESTIMATE_UNIT,
    MEMORY_UNITS,
    OUTSIDE_STUDY,
    REGION_STUDIES,
    ExpertsSweepRow,
    Row,
    largest_shape,
    sweep_ops,
)
from .step_report import step_section
from .targets import Result, counted_targets, evaluate
from .timed import HOST_COST_STUDY, OVERHEAD_STUDY

README_BEGIN, README_END = "<!-- bench:begin -->", "<!-- bench:end -->"
FLOOR_TEXT = (
    "each fused region as the fewest kernels that compute it, each reading its inputs and writing its outputs once"
)


def _pairs(rows: list[Row]) -> list[tuple[Row, Row]]:
    """(ops row, bytes row) of each measurement, in the rows' order."""
    size = {_measured(r): r for r in rows if r.unit == "bytes"}
    return [(r, size[_measured(r)]) for r in rows if r.unit == "ops"]


def _measured(r: Row) -> tuple:
    """What a row measures, whatever its unit."""
    return r.study, r.model, r.kind, r.phase, r.batch, r.seq, r.path, r.chunk, r.experts


NOT_PATCHED_MARK = " †"
NOT_PATCHED_LEGEND = "† not patched by the peer: it leaves the region to transformers, so its figure is eager's."


def _peer(row: Row | ExpertsSweepRow, unit: str) -> str:
    """A peer cell: the figure, marked when the peer leaves the region to transformers."""
    return number(row.peer, unit) + (NOT_PATCHED_MARK if row.peer_patched is False else "")


def _ratio(value: float | None, floor: float | None) -> str:
    return "-" if value is None or not floor else f"{value / floor:.2f}"


def counted_table(rows: list[Row], kinds: tuple[str, ...] | None = None) -> list[str]:
    """Render the counted table of the largest shape, forward+backward.

    Per model and region kind (all of them, or `kinds`), ops and bytes eager, kernelized, the peer's (when measured) and
    at the floor, and bytes / floor."""
    counted = [r for r in rows if r.study in REGION_STUDIES and (kinds is None or r.kind in kinds)]
    if not counted:
        return []
    batch, seq = largest_shape(counted)
    chosen = [r for r in counted if r.phase == "fwd+bwd" and (r.batch, r.seq) == (batch, seq)]
    peer = any(r.peer is not None for r in chosen)
    body = []
    for ops, size in _pairs(chosen):
        cells = [ops.model, ops.kind, number(ops.eager, "ops")]
        cells += [NO_CARD if ops.kernelized is None else number(ops.kernelized, "ops")]
        cells += [_peer(ops, "ops")] if peer else []
        cells += [number(ops.floor, "ops"), human_bytes(size.eager), human_bytes(size.kernelized)]
        cells += [_peer(size, "bytes")] if peer else []
        cells += [human_bytes(size.floor), _ratio(size.kernelized, size.floor)]
        cells += [_ratio(size.peer, size.floor)] if peer else []
        body.append(cells)
    header = ["model", "region", "ops eager", "kernelized", *(["peer"] if peer else []), "floor"]
    header += ["bytes eager", "kernelized", *(["peer"] if peer else []), "floor", "ratio"]
    header += ["peer ratio"] if peer else []
    title = f"Counted, forward+backward, batch {batch}, sequence {seq}, bfloat16 (ratio: kernelized bytes / floor "
    title += "bytes; peer ratio: the peer's bytes / floor bytes):" if peer else "bytes):"
    legend = ["", NOT_PATCHED_LEGEND] if any(r.peer_patched is False for r in chosen) else []
    return ["", title, "", *table(header, body), *legend]


def region_time_table(rows: list[Row], kinds: tuple[str, ...] | None = None) -> list[str]:
    """Render each region's estimated time against eager's, at the largest shape, forward+backward.

    Per model and region kind (all of them, or `kinds`): the estimated Atlas A2 device time of its ops, eager,
    kernelized and the peer's (when measured), and kernelized / eager."""
    estimated = [
        r for r in rows
        if r.study in REGION_STUDIES and r.unit == ESTIMATE_UNIT and r.phase == "fwd+bwd"
        and (kinds is None or r.kind in kinds)
    ]  # fmt: skip
    if not estimated:
        return []
    batch, seq = largest_shape(estimated)
    chosen = [r for r in estimated if (r.batch, r.seq) == (batch, seq)]
    peer = any(r.peer is not None for r in chosen)
    body = []
    for r in chosen:
        cells = [r.model, r.kind, f"{r.eager:.2f}", NO_CARD if r.kernelized is None else f"{r.kernelized:.2f}"]
        cells += [_peer(r, ESTIMATE_UNIT)] if peer else []
        cells += [_ratio(r.kernelized, r.eager), *([_ratio(r.peer, r.eager)] if peer else [])]
        body.append(cells)
    header = ["model", "region", "eager ms", "kernelized ms", *(["peer ms"] if peer else []), "kernelized / eager"]
    header += ["peer / eager"] if peer else []
    title = (
        f"Estimated time of each region, forward+backward, batch {batch}, sequence {seq}, bfloat16 (**estimate**: "
        "the Atlas A2 model's device time of the region's counted ops, docs/step-model.md; a region of several "
        "modules, the norms, sums them; every size the bench counts is in bench.csv, unit "
        f"'{ESTIMATE_UNIT}'):"
    )
    legend = ["", NOT_PATCHED_LEGEND] if peer and any(r.peer_patched is False for r in chosen) else []
    return ["", title, "", *table(header, body), *legend]


MEMORY_TEXT = (
    "bytes kept for backward at the end of the forward (saved: distinct storages autograd's saved tensors hold) and "
    "the peak of live bytes over the forward and backward, above the parameters, buffers and inputs (not counted), "
    "on fake tensors: every storage an op allocates, live until its last reference dies; each fused op keeps what "
    "the real op keeps"
)


def memory_table(rows: list[Row], kinds: tuple[str, ...] | None = None) -> list[str]:
    """Render the memory table of the largest shape, forward+backward.

    Per model and region kind (all of them, or `kinds`), saved and peak bytes eager, kernelized, the peer's (when
    measured) and at the floor."""
    saved = [
        r
        for r in rows
        if r.study in REGION_STUDIES and r.unit == MEMORY_UNITS[0] and (kinds is None or r.kind in kinds)
    ]
    if not saved:
        return []
    batch, seq = largest_shape(saved)
    peaks = {_measured(r): r for r in rows if r.unit == MEMORY_UNITS[1]}
    chosen = [(r, peaks[_measured(r)]) for r in saved if (r.batch, r.seq) == (batch, seq)]
    peer = any(r.peer is not None for pair in chosen for r in pair)
    body = []
    for kept, peak in chosen:
        cells = [kept.model, kept.kind]
        for r in (kept, peak):
            cells += [human_bytes(r.eager), NO_CARD if r.kernelized is None else human_bytes(r.kernelized)]
            cells += [_peer(r, "bytes")] if peer else []
            cells += [human_bytes(r.floor)]
        body.append(cells)
    columns = ["eager", "kernelized", *(["peer"] if peer else []), "floor"]
    header = ["model", "region", f"saved {columns[0]}", *columns[1:], f"peak {columns[0]}", *columns[1:]]
    title = f"Memory, counted, forward+backward, batch {batch}, sequence {seq}, bfloat16: {MEMORY_TEXT}. A region "
    title += "kind's saved bytes are the sum over its regions, its peak the largest of theirs (they run one after "
    title += "the other). Floor saved: what the fewest kernels keep (each card's `floor_saved`); floor peak: derived, "
    title += "floor saved plus the least transient part (peak - saved) of the eager and kernelized runs "
    title += "(`scripts/bench/floors.py`). No memory target is set:"
    legend = ["", NOT_PATCHED_LEGEND] if peer and any(r.peer_patched is False for r, _ in chosen) else []
    return ["", title, "", *table(header, body), *legend]


def _prefill_decode_table(card: Card, rows: list[Row]) -> list[str]:
    """Render the prefill/decode table: forward ops and bytes of one call of the card's region.

    Eager and kernelized: prefill (1 x 4096), decode (1 x 1) (a card's spec asks for it: PREFILL_DECODE_TABLE)."""
    calls = [
        r for r in rows
        if r.study == "layer" and r.kind == card.region and r.phase == "fwd" and (r.batch, r.seq) in PREFILL_DECODE
    ]  # fmt: skip
    if not calls:
        return []
    peer = any(r.peer is not None for r in calls)
    body = []
    for ops, size in sorted(_pairs(calls), key=lambda pair: (pair[0].model, -int(pair[0].seq))):
        cells = [ops.model, str(ops.seq), number(ops.eager, "ops"), number(ops.kernelized, "ops")]
        cells += [_peer(ops, "ops")] if peer else []
        cells += [human_bytes(size.eager), human_bytes(size.kernelized)]
        cells += [_peer(size, "bytes")] if peer else []
        body.append(cells)
    title = f"Counted, one {card.region} call, forward (inference mode), prefill (batch 1, 4096 tokens) and decode "
    title += "(batch 1, 1 token):"
    header = ["model", "tokens", "ops eager", "kernelized", *(["peer"] if peer else [])]
    header += ["bytes eager", "kernelized", *(["peer"] if peer else [])]
    return ["", title, "", *table(header, body)]


def _sweep_table(card: Card, rows: list[Row]) -> list[str]:
    """The experts sweep of the card's region (its spec's EXPERTS_SWEEP), forward+backward ops."""
    sweep = sweep_ops(rows, card.region)
    if not sweep:
        return []
    peer = any(r.peer is not None for r in sweep)
    grouped = {r.experts: r for r in sweep if r.implementation == "grouped_mm"}
    body = []
    for loop in (r for r in sweep if r.implementation == "eager"):
        cells = [str(loop.experts), number(loop.eager, "ops"), number(grouped[loop.experts].eager, "ops")]
        cells += [NO_CARD if loop.kernelized is None else number(loop.kernelized, "ops")]
        cells += [_peer(loop, "ops")] if peer else []
        body.append([*cells, number(loop.floor, "ops")])
    model = sweep[0].model
    title = f"Counted, the {card.region} of a {model} layer with E experts (top-8, batch 1, sequence 512), "
    title += "forward+backward ops:"
    header = ["experts", "transformers eager loop", "transformers grouped_mm", card.repo_name]
    header += ["peer"] if peer else []
    return ["", title, "", *table([*header, "floor"], body)]


def outside_tables(card: Card, region: OutsideRegion, rows: list[Row]) -> list[str]:
    """Render the tables of a card's region outside the decoder layer.

    For its spec's OUTSIDE_REGION: the chunk trade (`_chunk_table`), then the extra column beside eager and the card
    (`_extra_table`)."""
    return _chunk_table(card, region, rows) + _extra_table(card, region, rows)


def _chunk_table(card: Card, region: OutsideRegion, rows: list[Row]) -> list[str]:
    """Render the chunk table: eager against the card at each chunk, per model.

    At the largest shape counted, the card at its default chunk and at each swept chunk: forward+backward ops, bytes and
    peak live bytes, and whether the card's counted targets are met there."""
    chosen = [r for r in rows if r.kind == card.region and r.study in (OUTSIDE_STUDY, CHUNK_STUDY)]
    if not chosen:
        return []
    batch, seq = largest_shape(chosen)
    chosen = [r for r in chosen if (r.batch, r.seq) == (batch, seq)]
    held = [t for t in counted_targets() if t.kind == card.region and any(t.covers(r) for r in chosen)]
    body = []
    for model in dict.fromkeys(r.model for r in chosen):
        for chunk in sorted({r.chunk for r in chosen if r.model == model}):
            by_unit = {r.unit: r for r in chosen if (r.model, r.chunk) == (model, chunk)}
            ops, size, peak, time = (by_unit[unit] for unit in ("ops", "bytes", MEMORY_UNITS[1], ESTIMATE_UNIT))
            default = " (default)" if ops.study == OUTSIDE_STUDY else ""
            met = all(t.met(r) for t in held for r in by_unit.values() if t.covers(r))
            body.append([
                model, f"{chunk}{default}", f"{number(ops.eager, 'ops')} / {number(ops.kernelized, 'ops')}",
                f"{human_bytes(size.eager)} / {human_bytes(size.kernelized)}", f"{size.kernelized / size.eager:.2f}",
                f"{human_bytes(peak.eager)} / {human_bytes(peak.kernelized)}", f"{peak.kernelized / peak.eager:.3f}",
                f"{time.eager:.1f} / {time.kernelized:.1f}", f"{time.kernelized / time.eager:.2f}",
                "yes" if met else "no",
            ])  # fmt: skip
    met_header = ", ".join(t.text.removeprefix("kernelized ").removesuffix(" (every size)") for t in held)
    header = ["model", "tokens per chunk", "ops eager / card", "bytes eager / card", "ratio"]
    header += ["peak live eager / card", "ratio", "est. ms eager / card", "ratio", f"met: {met_header}"]
    title = (
        f"Counted, the {card.region} region ({card.repo_name}), forward+backward, batch {batch}, sequence {seq}, "
        "bfloat16; peak live: the most bytes allocated at once (inputs and weights not counted). "
        f"{region.chunk_note}:"
    )
    return ["", title, "", *table(header, body)]


def _extra_table(card: Card, region: OutsideRegion, rows: list[Row]) -> list[str]:
    """Render the extra-column table: eager, the card and each variant of the region's extra column.

    Per model and shape, forward+backward: ops, bytes, saved and peak live bytes; or why the extra column was not
    counted."""
    extra = region.extra
    if extra is None:
        return []
    chosen = [r for r in rows if r.kind == card.region and r.study in extra.studies]
    if not chosen:
        absent = extra.absent()
        counted = any(r.study == OUTSIDE_STUDY and r.kind == card.region for r in rows)
        return ["", f"{extra.label}: not counted here ({absent})."] if absent and counted else []
    units = ("ops", "bytes", *MEMORY_UNITS)
    body = []
    for model, batch, seq, study in dict.fromkeys((r.model, r.batch, r.seq, r.study) for r in chosen):
        by_unit = {r.unit: r for r in chosen if (r.model, r.batch, r.seq, r.study) == (model, batch, seq, study)}
        cells = [model, f"{batch} x {seq}", extra.studies[study]]
        for unit in units:
            figures = (by_unit[unit].eager, by_unit[unit].kernelized, by_unit[unit].extra)
            cells.append(" / ".join(number(v, "ops") if unit == "ops" else human_bytes(v) for v in figures))
        cells.append(f"{by_unit['bytes'].extra / by_unit['bytes'].kernelized:.1f}")
        body.append(cells)
    columns = f"eager / card / {extra.name}"
    header = ["model", "batch x seq", extra.header, f"ops {columns}", f"bytes {columns}", f"saved {columns}"]
    header += [f"peak live {columns}", f"{extra.name} bytes / card bytes"]
    return ["", extra.title(), "", *table(header, body)]


def _parity_table(rows: list[Row]) -> list[str]:
    """Per peer kernel: the tiny model families where its output matches eager's, differs, and the others."""
    parity = [ParityRow.of(r) for r in rows if r.study == PARITY_STUDY]
    if not parity:
        return []
    by_kernel: dict[str, dict[str, list[str]]] = {}
    for r in parity:
        found = by_kernel.setdefault(r.kernel, {outcome: [] for outcome in OUTCOMES})
        found[r.outcome].append(f"{r.family} ({r.max_diff:.1g})" if r.outcome == "differs" else r.family)
    body = [[kernel, *(", ".join(found[o]) or "-" for o in OUTCOMES)] for kernel, found in by_kernel.items()]
    families = len({r.family for r in parity})
    title = f"Peer parity: each peer kernel alone on the {families} tiny model families of "
    title += "`npu_hub_kernels.testing.tiny_models` (float32, emulated npu device), logits against eager's; matches: "
    title += f"max |diff| <= {PARITY_TOLERANCE:g} (in parentheses when it differs):"
    return ["", title, "", *table(["peer kernel", *OUTCOMES], body)]


def _targets_table(rows: list[Row], kinds: tuple[str, ...] | None, met_text: dict) -> list[str]:
    results = [r for r in evaluate(rows) if kinds is None or r.kind in kinds]
    return table(["target", "measured", "met"], [[r.target, r.measured, met_text[r.met]] for r in results])


def peer_text(peer: str | None, absent: str = "") -> str:
    """The summary's line about the peer column: what it is, or why it is left out."""
    if peer is None:
        return f"- Peer: not run here ({absent}), so no peer column." if absent else ""
    return (
        f"- **Peer**: {peer}'s in-tree NPU kernels (`llamafactory.v1.plugins.model_plugins.kernels`, "
        '`apply_default_kernels(model, "auto")`), counted on a layer of its own built like the others '
        "(its module-global patches set only while it runs): RMSNorm by class name, its SwiGLU MLPs by class list "
        "(gate and up concatenated per call), npu_rotary_mul for q and k, and grouped-matmul experts for Qwen3-MoE "
        "only (`config.architectures` set as a Hub checkpoint's). It is not part of any floor or target."
    )


def summary(
    rows: list[Row],
    machine: str,
    versions: str,
    table_path: str = ".cache/bench/bench.csv",
    peer: str | None = None,
    peer_absent: str = "",
) -> str:
    """Render the markdown summary: every table (summary.md, and the tables page docs/benchmarks.md).

    Counted and timed figures, no emulated timing. `peer`: the peer's name when it ran, else `peer_absent` says why it
    did not."""
    lines = [
        f"`make bench` (`scripts/bench/`) on {machine}; {versions}. Every figure: `{table_path}`.",
        "",
        "- **Counted**, not timed: device operations (kernel launches: aten ops that are not views, and each fused "
        "op once) and the bytes each one reads and writes, for one decoder layer in bfloat16, on fake tensors under "
        "the torch_npu emulation. They do not depend on the machine. Floor: "
        f"{FLOOR_TEXT} (defined in `scripts/bench/floors.py` and, per card, `scripts/bench/cards/`).",
        "- Kernelized: the default path, `kernelize` and nothing else; no weight is copied or re-laid out. fwd runs "
        "in `torch.inference_mode()` (inference), fwd+bwd with grad (training).",
        *([peer_text(peer, peer_absent)] if peer or peer_absent else []),
        "- **Timed**: medians of repeats after warm-up, on the machine above.",
    ]
    real_device = [r for r in rows if r.study in ("device", "training") and not r.emulated]
    if not real_device:
        lines.append("- No Ascend device here, so no device timings (emulated ones are only in bench.csv, labelled).")
    lines += ["", *_targets_table(rows, None, {True: "yes", False: "**no**", None: "-"})]
    lines += counted_table(rows)
    lines += region_time_table(rows)
    lines += memory_table(rows)
    lines += step_section(rows)
    lines += attention_section(rows)
    lines += padding_free_section(rows)
    lines += long_context_section(rows)
    for card, _ in with_piece("PREFILL_DECODE_TABLE"):
        lines += _prefill_decode_table(card, rows)
    for card, _ in with_piece("EXPERTS_SWEEP"):
        lines += _sweep_table(card, rows)
    for card, region in with_piece("OUTSIDE_REGION"):
        lines += outside_tables(card, region, rows)
    lines += _parity_table(rows)
    host = [r for r in rows if r.study in ("kernelize", OVERHEAD_STUDY, HOST_COST_STUDY, "get_kernel", "fallback")]
    if host:
        body = [
            [f"{r.op} ({r.config})", number(r.eager, r.unit), number(r.kernelized, r.unit), r.unit, r.note]
            for r in host
        ]
        header = ["measurement", "what it is against (after vs)", "kernelized", "unit", "note"]
        lines += ["", "Timed on this machine, host side:", "", *table(header, body)]
    if real_device:
        body = [
            [
                r.config,
                r.op,
                r.phase,
                f"{r.batch} x {r.seq}",
                number(r.eager, r.unit),
                number(r.kernelized, r.unit),
                r.unit,
            ]
            for r in real_device
        ]
        header = ["model", "op", "phase", "batch x seq", "eager", "kernelized", "unit"]
        lines += ["", "Timed on the Ascend device:", "", *table(header, body)]
    return "\n".join(lines) + "\n"


def tables_page(text: str, charts: list[str]) -> str:
    """Render the tables page (docs/benchmarks.md): a title, the charts (links relative to the page), the summary."""
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`scripts/bench/`): do not edit by hand. How the bench measures: `docs/bench.md`.",
        *(line for chart in charts for line in ("", f"![{Path(chart).stem} chart]({chart})")),
        "",
        text.strip(),
    ]
    return "\n".join(lines) + "\n"


def readme_summary(results: list[Result], tables: str, chart: str | None = None) -> str:
    """Render the README's bench section: the targets met, each one missed, the step chart, the tables page's link.

    `results`: `targets.evaluate`'s (those with nothing measured yet are left out); `tables`, `chart`: links relative
    to the README."""
    results = [r for r in results if r.met is not None]
    missed = [r for r in results if r.met is False]
    met = f"**{len(results) - len(missed)} of {len(results)} targets met**"
    lines = [f"The last `make bench`: {met}" + ("; missed:" if missed else "."), ""]
    lines += [f"- {r.target}: {r.measured}" for r in missed] + ([""] if missed else [])
    lines += documented_reach_note()
    if chart:
        lines += [f"![The training step's estimated device time per model, eager against the cards]({chart})", ""]
    lines.append(f"Every target, table and chart: [{Path(tables).name}]({tables}).")
    return "\n".join(lines) + "\n"


def documented_reach_note() -> list[str]:
    """Render the bench's note on the targets set where torch_npu's documented ops cannot reach the floor.

    Why, per card (its spec's `OUT_OF_DOCUMENTED_REACH`, and its `BEFORE_CARD_TARGET`'s `why`), with the sources."""
    reasons = [reason for _, reason in with_piece("OUT_OF_DOCUMENTED_REACH")]
    reasons += [target.why for _, target in with_piece("BEFORE_CARD_TARGET")]
    if not reasons:
        return []
    head = (
        "Where no op torch_npu documents reaches a region's floor, the target is the documented minimum (the fewest "
        "documented calls computing the region, their bytes as their contracts state them; the floor wherever those "
        "reach it: `documented` in bench.csv), or as stated:"
    )
    return [head, "", *(f"- {reason}" for reason in reasons), ""]


def card_summary(card: str, rows: list[Row]) -> str:
    """Render a card's share of the summary, for its Hub README.

    Its targets and its region kind's counted figures (with the peer's, when measured), then the tables of its region
    outside the decoder layer (OUTSIDE_REGION), if any."""
    kinds = (card_named(card).region,)
    region = getattr(spec(card_named(card)), "OUTSIDE_REGION", None)
    peer = any(r.peer is not None for r in rows if r.study == "layer")
    lines = [
        "Counted by npu-hub-kernels' `make bench`: device operations and bytes on fake tensors under the torch_npu "
        "emulation, which do not depend on the machine (floor: each fused region as the fewest kernels, each reading "
        "its inputs and writing its outputs once). Kernelized: the default path, `kernelize` alone; forward in "
        "inference mode, forward+backward with grad."
        + (" Peer: LLaMA-Factory's in-tree NPU kernels on the same layers." if peer else ""),
        "",
        *_targets_table(rows, kinds, {True: "yes", False: "no", None: "not measured"}),
        *counted_table(rows, kinds),
        *region_time_table(rows, kinds),
        *memory_table(rows, kinds),
        *(attention_section(rows) if any(r.kind in kinds for r in rows if r.study == ATTENTION_STUDY) else []),
        *(outside_tables(card_named(card), region, rows) if region else []),
    ]
    return "\n".join(lines) + "\n"


def update_readme(path: Path, text: str) -> None:
    """Replace what lies between the bench markers of `path` with `text`; nothing else changes."""
    content = path.read_text()
    begin, end = content.find(README_BEGIN), content.find(README_END)
    if begin < 0 or end < begin:
        raise SystemExit(f"{path}: no {README_BEGIN} ... {README_END} markers; add them where the bench summary goes")
    path.write_text(content[: begin + len(README_BEGIN)] + "\n" + text.strip() + "\n" + content[end:])
