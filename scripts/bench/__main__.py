"""The `make bench` command: `python scripts/bench [options]`, or `python -m bench [options]` from scripts/.

See the package doc (`scripts/bench/__init__.py`) for what it measures, and `--help` for the options.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Before huggingface_hub is imported: get_kernel reads only the local offline cache seeded here (as the demo).
os.environ.setdefault("HF_HUB_CACHE", str(Path(__file__).resolve().parents[2] / ".cache" / "hub"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

if not __package__:  # `python scripts/bench`: run as the package `bench` of scripts/
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, str(Path(here).parent))
    import bench  # noqa: F401

    __package__ = "bench"

import argparse
import logging
import platform
import shutil

import torch

from npu_hub_kernels.cards import CARDS, resolve_org
from npu_hub_kernels.testing import emulation
from npu_hub_kernels.testing.tiny_models import TINY_CONFIGS

from . import __doc__ as package_doc
from .attention import attention_rows
from .cards import with_piece
from .chart import write_chart
from .configs import CONFIGS, QUICK_SHAPES, ROOT, SHAPES, TINY_SPECS
from .counted import before_card_rows, counted_rows, experts_sweep_rows
from .long_context import LONG_MODELS, longest_rows
from .long_context_report import write_long_context_chart
from .outside import outside_rows
from .padding_free import padding_free_rows
from .peer import load_peer, parity_rows
from .report import card_summary, readme_summary, summary, tables_page, update_readme
from .rows import Row, log, write_csv
from .step import STEP_MODELS
from .step_report import write_step_chart
from .step_study import step_rows
from .targets import LAYER_TARGET_SHAPE, evaluate, require_every_target_measured
from .timed import (
    device_rows,
    fallback_rows,
    get_kernel_rows,
    host_cost_rows,
    kernelize_rows,
    overhead_rows,
    training_rows,
)

CHARTS = ("step.png", "bench.png", "long_context.png")
"""The charts the bench draws in --out: the training step's estimated time, the counted and timed figures, and one
device's peak memory against the sequence length."""
QUICK_PARITY = ("llama", "qwen3_moe", "gemma3_text")
"""--quick: the peer parity check on these tiny families only."""


def describe_host(emulated: bool) -> tuple[str, str]:
    """(machine, versions) as the CSV and the summary state them."""
    import kernels
    import transformers

    device = "no NPU (torch_npu emulated)" if emulated else f"Ascend {torch.npu.get_device_name(0)}"
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, {device}"
    cann = f"CANN {getattr(torch.version, 'cann', '?')}{' (emulated)' if emulated else ''}"
    versions = (
        f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"kernels {kernels.__version__}, {cann}"
    )
    return machine, versions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench", description=package_doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "bench", help="output folder")
    parser.add_argument("--build", type=Path, default=ROOT / "build", help="folder of built cards (make build)")
    parser.add_argument("--org", default=None, help="Hub organisation of the cards in the offline cache")
    parser.add_argument(
        "--readme",
        type=Path,
        help="rewrite the bench section of this file (between its markers): targets met and missed, the step chart, a "
        "link to the tables (--tables)",
    )
    parser.add_argument("--tables", type=Path, help="write every table here (docs/benchmarks.md), with the charts")
    parser.add_argument("--images", type=Path, help="copy the charts here (docs/images) for --tables and --readme")
    parser.add_argument(
        "--cards-dir",
        type=Path,
        help="write each card's benchmark.md here (kernel-cards/): the build adds it to the card's Hub README",
    )
    parser.add_argument("--quick", action="store_true", help="batch 1 x sequence 512 only, fewer repeats")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument(
        "--only",
        choices=("counted", "timed", "long-context"),
        help="run one mode only; long-context: the longest-trainable-sequence study alone (counted, minutes)",
    )
    parser.add_argument(
        "--peer",
        choices=("auto", "off"),
        default="auto",
        help="auto: count LLaMA-Factory's NPU kernels beside the cards when it is installed; off: no peer column",
    )
    parser.add_argument(
        "--device-timing",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: on an Ascend host only; on: also on the emulation (small shapes, labelled emulated)",
    )
    args = parser.parse_args(argv)
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown config(s) {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    specs = [CONFIGS[name] for name in args.configs.split(",")]
    quick = args.quick
    logging.getLogger("kernels").setLevel(logging.ERROR)  # "no mapping for ... cpu": how the eager forwards return

    from npu_hub_kernels import register_npu_kernels, unregister_npu_kernels

    emulated = not emulation.real_npu()
    if emulated:
        emulation.install()
    register_npu_kernels(local_dir=args.build)
    machine, versions = describe_host(emulated)
    log(f"bench: {machine}; {versions}")
    rows: list[Row] = []
    counted = args.only in (None, "counted") and emulated
    peer, peer_absent = None, "--peer off"
    try:
        if args.only in (None, "counted"):
            if emulated:
                if args.peer == "auto":
                    peer, peer_absent = load_peer()
                log(f"counted: fusion accounting on fake tensors; peer: {peer.name if peer else peer_absent}")
                for spec in specs:
                    rows += counted_rows(spec, QUICK_SHAPES if quick else SHAPES, peer)
                for card, sweep in with_piece("EXPERTS_SWEEP"):
                    rows += experts_sweep_rows(card, sweep.model, sweep.quick if quick else sweep.experts, peer=peer)
                for card, region in with_piece("OUTSIDE_REGION"):
                    rows += outside_rows(card, region, specs, quick)
                for card, target in with_piece("BEFORE_CARD_TARGET"):
                    rows += before_card_rows(card, target, specs, QUICK_SHAPES[0] if quick else LAYER_TARGET_SHAPE)
                steps = tuple(k for k in STEP_MODELS if k not in CONFIGS or CONFIGS[k] in specs)
                rows += attention_rows([STEP_MODELS[k].spec for k in steps], quick)
                rows += step_rows(peer, quick, args.build, steps)
                rows += padding_free_rows(args.build, quick, steps)
                if not quick:  # searches lengths up to millions of tokens: minutes, not a quick run's seconds
                    rows += longest_rows(peer, tuple(k for k in LONG_MODELS if k in steps))
                if peer is not None:
                    rows += parity_rows(peer, QUICK_PARITY if quick else TINY_CONFIGS)
            else:
                log("counted: skipped; it runs on the torch_npu emulation (the counts do not depend on the host)")
        if args.only == "long-context" and emulated:
            if args.peer == "auto":
                peer, peer_absent = load_peer()
            rows += longest_rows(peer, tuple(k for k in LONG_MODELS if k not in CONFIGS or CONFIGS[k] in specs))
        if args.only in (None, "timed"):
            log("timed: host side")
            rows += kernelize_rows(5 if quick else 21)
            rows += overhead_rows("cpu" if emulated else "npu", 5 if quick else 15, 200 if quick else 2000)
            rows += host_cost_rows("npu", 5 if quick else 15, 200 if quick else 2000)
            rows += get_kernel_rows(args.build, resolve_org(args.org), 1 if quick else 3, 3 if quick else 10, emulated)
            rows += fallback_rows(args.build, 3 if quick else 9, quick)
            if args.device_timing == "on" or (args.device_timing == "auto" and not emulated):
                log(f"timed: device{' (emulated, not a device measurement)' if emulated else ''}")
                shapes = ((2, 16),) if emulated else QUICK_SHAPES if quick else ((1, 4096),)
                repeats = 3 if quick or emulated else 10
                rows += device_rows(TINY_SPECS if emulated else specs, shapes, "npu", emulated, repeats)
                rows += training_rows("npu", emulated, repeats)
    finally:
        unregister_npu_kernels()
    if counted and len(specs) == len(CONFIGS):
        require_every_target_measured(rows)
    for row in rows:
        row.machine, row.versions = machine, versions
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, args.out / "bench.csv")
    table = args.out.resolve() / "bench.csv"
    where = str(table.relative_to(ROOT) if table.is_relative_to(ROOT) else table)
    text = summary(rows, machine, versions, where, peer.name if peer else None, peer_absent if counted else "")
    (args.out / "summary.md").write_text(text)
    for name in CHARTS:  # none left from an earlier run
        (args.out / name).unlink(missing_ok=True)
    problem = (
        write_chart(rows, args.out / "bench.png", machine)
        or write_step_chart(rows, args.out / "step.png")
        or write_long_context_chart(rows, args.out / "long_context.png")
    )
    charts = [args.out / name for name in CHARTS if (args.out / name).exists()]
    if args.images:
        args.images.mkdir(parents=True, exist_ok=True)
        charts = [Path(shutil.copy(chart, args.images / chart.name)) for chart in charts]
    tables = args.tables or args.out / "summary.md"
    if args.tables:
        tables.write_text(tables_page(text, [os.path.relpath(chart, tables.parent) for chart in charts]))
    if args.readme:
        here = args.readme.parent
        step_chart = next((os.path.relpath(c, here) for c in charts if c.name == "step.png"), None)
        update_readme(args.readme, readme_summary(evaluate(rows), os.path.relpath(tables, here), step_chart))
    for card in CARDS.values() if args.cards_dir else ():
        (args.cards_dir / card.repo_name / "benchmark.md").write_text(card_summary(card.repo_name, rows))
    log(problem or f"wrote {args.out}: bench.csv ({len(rows)} rows), bench.png, step.png, summary.md")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
