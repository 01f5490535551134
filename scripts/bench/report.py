"""The markdown the bench writes: summary.md, the README section between the bench markers, and each card's
benchmark.md. One table renderer (`table`), and one renderer of the counted table (`counted_table`) for all three.
"""

from __future__ import annotations

from pathlib import Path

from .cards import KINDS, NO_CARD
from .configs import PREFILL_DECODE
from .rows import Row
from .targets import evaluate

README_BEGIN, README_END = "<!-- bench:begin -->", "<!-- bench:end -->"
FLOOR_TEXT = (
    "each fused region as the fewest kernels that compute it, each reading its inputs and writing its outputs once"
)


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def number(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return human_bytes(value) if unit == "bytes" else f"{value:.0f}" if unit == "ops" else f"{value:.3g}"


def table(header: list[str], body: list[list[str]]) -> list[str]:
    """A markdown table: the header, its rule, one line per row."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells) + " |" for cells in body),
    ]


def _pairs(rows: list[Row]) -> list[tuple[Row, Row]]:
    """(ops row, bytes row) of each measurement, in the rows' order."""
    size = {
        (r.study, r.model, r.kind, r.phase, r.batch, r.seq, r.path, r.experts): r for r in rows if r.unit == "bytes"
    }
    return [
        (r, size[(r.study, r.model, r.kind, r.phase, r.batch, r.seq, r.path, r.experts)])
        for r in rows
        if r.unit == "ops"
    ]


def _largest_shape(rows: list[Row]) -> tuple[int, int]:
    _, batch, seq = max((r.batch * r.seq, r.batch, r.seq) for r in rows)
    return batch, seq


def counted_table(rows: list[Row], kinds: tuple[str, ...] | None = None) -> list[str]:
    """The counted table of the largest shape, forward+backward: per model and region kind (all of them, or
    `kinds`), ops and bytes eager, kernelized and at the floor, and kernelized bytes / floor bytes."""
    counted = [r for r in rows if r.study == "layer" and (kinds is None or r.kind in kinds)]
    if not counted:
        return []
    batch, seq = _largest_shape(counted)
    chosen = [r for r in counted if r.phase == "fwd+bwd" and (r.batch, r.seq) == (batch, seq)]
    body = []
    for ops, size in _pairs(chosen):
        kernelized = NO_CARD if ops.kernelized is None else number(ops.kernelized, "ops")
        ratio = "-" if size.ratio is None else f"{size.ratio:.2f}"
        body.append(
            [
                ops.model,
                ops.kind,
                number(ops.eager, "ops"),
                kernelized,
                number(ops.floor, "ops"),
                human_bytes(size.eager),
                human_bytes(size.kernelized),
                human_bytes(size.floor),
                ratio,
            ]
        )
    header = ["model", "region", "ops eager", "kernelized", "floor", "bytes eager", "kernelized", "floor", "ratio"]
    title = (
        f"Counted, forward+backward, batch {batch}, sequence {seq}, bfloat16 (ratio: kernelized bytes / floor bytes):"
    )
    return ["", title, "", *table(header, body)]


def _mlp_prefill_decode_table(rows: list[Row]) -> list[str]:
    """Forward ops and bytes of one SwiGLU MLP call, eager and kernelized: prefill (1 x 4096), decode (1 x 1)."""
    mlp = [
        r for r in rows
        if r.study == "layer" and r.kind == "SwiGLU MLP" and r.phase == "fwd" and (r.batch, r.seq) in PREFILL_DECODE
    ]  # fmt: skip
    if not mlp:
        return []
    body = [
        [
            ops.model,
            str(ops.seq),
            number(ops.eager, "ops"),
            number(ops.kernelized, "ops"),
            human_bytes(size.eager),
            human_bytes(size.kernelized),
        ]
        for ops, size in sorted(_pairs(mlp), key=lambda pair: (pair[0].model, -int(pair[0].seq)))
    ]
    title = "Counted, one SwiGLU MLP call, forward (inference mode), prefill (batch 1, 4096 tokens) and decode "
    title += "(batch 1, 1 token):"
    header = ["model", "tokens", "ops eager", "kernelized", "bytes eager", "kernelized"]
    return ["", title, "", *table(header, body)]


def _sweep_table(rows: list[Row]) -> list[str]:
    sweep = [r for r in rows if r.study == "experts sweep" and r.phase == "fwd+bwd" and r.unit == "ops"]
    if not sweep:
        return []
    grouped = {r.experts: r for r in sweep if r.path == "grouped_mm"}
    body = [
        [
            str(loop.experts),
            number(loop.eager, "ops"),
            number(grouped[loop.experts].eager, "ops"),
            NO_CARD if loop.kernelized is None else number(loop.kernelized, "ops"),
            number(loop.floor, "ops"),
        ]
        for loop in sweep
        if loop.path == "eager"
    ]
    model = sweep[0].model
    title = f"Counted, the MoE experts of a {model} layer with E experts (top-8, batch 1, sequence 512), "
    title += "forward+backward ops:"
    header = ["experts", "transformers eager loop", "transformers grouped_mm", "npu-moe", "floor"]
    return ["", title, "", *table(header, body)]


def _targets_table(rows: list[Row], kinds: tuple[str, ...] | None, met_text: dict) -> list[str]:
    results = [r for r in evaluate(rows) if kinds is None or r.kind in kinds]
    return table(["target", "measured", "met"], [[r.target, r.measured, met_text[r.met]] for r in results])


def summary(rows: list[Row], machine: str, versions: str, table_path: str = ".cache/bench/bench.csv") -> str:
    """The markdown summary (summary.md and the README section): counted and timed figures, no emulated timing."""
    lines = [
        f"`make bench` (`scripts/bench/`) on {machine}; {versions}. Every figure: `{table_path}`.",
        "",
        "- **Counted**, not timed: device operations (kernel launches: aten ops that are not views, and each fused "
        "op once) and the bytes each one reads and writes, for one decoder layer in bfloat16, on fake tensors under "
        "the torch_npu emulation. They do not depend on the machine. Floor: "
        f"{FLOOR_TEXT} (defined in `scripts/bench/floors.py`).",
        "- Kernelized: the default path, `kernelize` and nothing else. Split MLPs pack gate/up into one buffer on "
        "their first call, a one-time cost: one uncounted warm-up forward runs first. fwd runs in "
        "`torch.inference_mode()` (inference), fwd+bwd with grad (training).",
        "- **Timed**: medians of repeats after warm-up, on the machine above.",
    ]
    real_device = [r for r in rows if r.study in ("device", "training") and not r.emulated]
    if not real_device:
        lines.append("- No Ascend device here, so no device timings (emulated ones are only in bench.csv, labelled).")
    lines += ["", *_targets_table(rows, None, {True: "yes", False: "**no**", None: "-"})]
    lines += counted_table(rows)
    lines += _mlp_prefill_decode_table(rows)
    lines += _sweep_table(rows)
    host = [r for r in rows if r.study in ("kernelize", "call overhead", "get_kernel", "fallback")]
    if host:
        body = [
            [f"{r.op} ({r.config})", number(r.eager, r.unit), number(r.kernelized, r.unit), r.unit, r.note]
            for r in host
        ]
        header = ["measurement", "eager or direct", "kernelized", "unit", "note"]
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


def card_summary(card: str, rows: list[Row]) -> str:
    """A card's share of the summary, for its Hub README: its targets and its region kind's counted figures."""
    kinds = (KINDS[card],)
    lines = [
        "Counted by npu-hub-kernels' `make bench`: device operations and bytes on fake tensors under the torch_npu "
        "emulation, which do not depend on the machine (floor: each fused region as the fewest kernels, each reading "
        "its inputs and writing its outputs once). Kernelized: the default path, `kernelize` alone; forward in "
        "inference mode, forward+backward with grad.",
        "",
        *_targets_table(rows, kinds, {True: "yes", False: "no", None: "not measured"}),
        *counted_table(rows, kinds),
    ]
    return "\n".join(lines) + "\n"


def update_readme(path: Path, text: str) -> None:
    """Replace what lies between the bench markers of `path` with `text`; nothing else changes."""
    content = path.read_text()
    begin, end = content.find(README_BEGIN), content.find(README_END)
    if begin < 0 or end < begin:
        raise SystemExit(f"{path}: no {README_BEGIN} ... {README_END} markers; add them where the bench summary goes")
    path.write_text(content[: begin + len(README_BEGIN)] + "\n" + text.strip() + "\n" + content[end:])
