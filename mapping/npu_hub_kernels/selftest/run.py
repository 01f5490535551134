"""`python -m npu_hub_kernels selftest`: every card against its eager math on this host's device, and a report.

    python -m npu_hub_kernels selftest [--model M] [--quick] [--json PATH] [--org ORG] [--version N]
                                       [--local-dir DIR] [--cards IDS] [--no-record]

For every card the loader resolves (the Hub at `--org`/`--version`, or the built cards of `--local-dir`), at the
widths of `--model` (a local folder or Hub id: its config.json only, through `transformers.AutoConfig`; no weights)
or of `DEFAULT_MODELS`, at a few small token counts:

- each fused form the card uses (`cases/<card>.py`'s `FORMS`), forward and backward, in each dtype it fuses, against
  the eager math on the same device, judged as the test suite judges (`forms.judge`);
- the ledger's refusal probes (`CASES`: one call just inside each documented limit of the ops, one just past it) and
  the card at its limits (`LIMITS`): a device that refuses a call the ledger accepts is a bug to report, one that
  accepts a call the ledger refuses is a finding. Reported, never fatal;
- each form's region timed fused and eager on the device (synchronised, the median of repeats);
- the environment: torch, torch_npu, CANN, device name, driver, the build variant of each card.

A card none of whose forms was judged (none applies at these widths, or the card runs each eager here) is `not run`,
never `pass`. On the CPU emulation of torch_npu, a form whose matmuls are too many for a CPU runs at narrower widths
(`EMULATION_FLOPS`), which the report says.

Before any form runs it checks that it can write the report (`--json`) and the results folder. It prints progress
and a table, keeps the result for this host (`results.save_result`, merged with the other cards' earlier results;
unless `--no-record`), so that `register_npu_kernels()` stands down every card form that failed here, and writes the
JSON report (schema in docs/selftest.md). Exit status 0 when no card failed, 1 when one did (or the device refused a
call the ledger accepts), 2 when this host has no npu device, `--cards` names an unknown card, or the report or the
result cannot be written (before the run; or at its end, saying what was kept where).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ..cards import CARDS, Card, resolve_org
from . import forms, results
from .cases import NotRunHere, cases_of
from .forms import ALL_LAYERS, NARROWED, Form, Widths

DEFAULT_MODELS = (
    # meta-llama/Meta-Llama-3-8B config.json: hidden_size 4096, intermediate_size 14336, num_attention_heads 32,
    # num_key_value_heads 8 (head dim 4096 / 32 = 128), vocab_size 128256, rms_norm_eps 1e-05
    Widths("meta-llama/Meta-Llama-3-8B", 4096, 14336, 32, 8, 128, 128256, eps=1e-5),
    # Qwen/Qwen3-30B-A3B config.json: hidden_size 2048, intermediate_size 6144, num_attention_heads 32,
    # num_key_value_heads 4, head_dim 128, vocab_size 151936, num_experts 128, num_experts_per_tok 8,
    # moe_intermediate_size 768, rms_norm_eps 1e-06
    Widths("Qwen/Qwen3-30B-A3B", 2048, 6144, 32, 4, 128, 151936, 128, 8, 768, eps=1e-6),
)
"""The widths the selftest runs at without --model: a dense and a mixture-of-experts model of common sizes."""
TOKENS = (16, 128)
"""The token counts each form runs at (`--quick`: the first, and the first model only)."""
REPEATS = {True: 3, False: 10}
"""Timed repeats of each region, quick or not (after one warm-up call)."""

A2_SECONDS_PER_JUDGEMENT = 0.5
"""Estimated seconds for one form judged in one dtype at one shape on an Atlas A2 host: fused, eager and their
backward on the device (a few ms) and the float64 reference on the host (up to ~20 GFLOP at Llama-3-8B's MLP widths,
most of the time). An estimate from the op counts, not a measurement: no A2 was at hand."""
HOST_FLOPS = 2e10
"""Float64 operations per second of the host's float64 reference (a server CPU's few cores): where a form's matmuls
make its reference long (`Form.flops`), that time is added to `A2_SECONDS_PER_JUDGEMENT`."""
A2_SECONDS_PER_TIMED_CALL = 0.01
"""Estimated seconds of one timed region call (forward and backward, synchronised) on an A2."""
A2_SECONDS_PER_PROBE = 0.005
"""Estimated seconds of one refusal probe or limit case (a few tiny op calls) on an A2."""
EMULATION_FLOPS = 5e8
"""On the CPU emulation of torch_npu, a form whose matmuls (`Form.flops`) would take more floating-point operations
than this at a model's widths runs at those widths divided by a power of two (`emulation_divisor`): a CPU computes
float16 matmuls at about 1 GFLOP/s, and the loss card's chunked form alone would take hours at Llama-3-8B's."""
EMULATION_NOTE = (
    f"CPU emulation of torch_npu: a form whose matmuls exceed {EMULATION_FLOPS / 1e9:g} GFLOP at a model's widths "
    "ran at its hidden, intermediate, experts' intermediate and vocabulary widths divided by a power of two "
    "(emulation_widths in its rows), as a CPU computes float16 matmuls at about 1 GFLOP/s"
)
"""The report's `emulation`, on the emulation (null on a device)."""
JUDGED = ("pass", "fail", "error")
"""The statuses of a form that was judged on the device (`eager`: the card did not fuse it there)."""

Progress = Callable[[str], None]


def widths_of_config(config: Any, model: str) -> Widths:
    """The widths the forms need, read from a transformers config (its text config for a multimodal model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    experts = next((getattr(text, n) for n in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(text, n, None)), 0)  # fmt: skip
    return Widths(
        model=model,
        hidden=text.hidden_size,
        intermediate=getattr(text, "intermediate_size", None) or 4 * text.hidden_size,
        heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
        vocab=text.vocab_size,
        experts=experts,
        top_k=getattr(text, "num_experts_per_tok", 0) if experts else 0,
        moe_intermediate=getattr(text, "moe_intermediate_size", 0) if experts else 0,
        eps=getattr(text, "rms_norm_eps", 1e-6),
    )


def model_widths(model: str | None) -> list[Widths]:
    """The widths of `model` (a folder or Hub id: config.json only), else `DEFAULT_MODELS`."""
    if model is None:
        return list(DEFAULT_MODELS)
    from transformers import AutoConfig

    return [widths_of_config(AutoConfig.from_pretrained(model), model)]


def environment() -> dict[str, Any]:
    """torch, torch_npu, CANN, the device and its driver, and the libraries that load the cards."""
    host = results.host_key() or {}
    return {
        "python": platform.python_version(),
        "platform": f"{platform.machine()}-{platform.system().lower()}",
        "torch": torch.__version__,
        "torch_npu": host.get("torch_npu", "not installed"),
        "emulated": emulated(),
        "cann": host.get("cann", "unknown"),
        "device": host.get("device", "none"),
        "device_count": torch.npu.device_count() if host else 0,
        "driver": _driver_version(),
        **{name: _version_of(name) for name in ("kernels", "transformers", "huggingface_hub", "npu-hub-kernels")},
    }


def emulated() -> bool:
    """Whether the torch_npu in use is the CPU emulation (npu_hub_kernels.testing.emulation), not a device's."""
    return bool(getattr(sys.modules.get("torch_npu"), "__emulated__", False))


def run_selftest(
    *,
    model: str | None = None,
    quick: bool = False,
    org: str | None = None,
    version: int = 1,
    local_dir: str | Path | None = None,
    cards: list[Card] | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Run the selftest on this host's npu device and return its report (docs/selftest.md).

    Raises RuntimeError when the host has no npu device (torch_npu missing, or no device visible).
    """
    say = progress or (lambda line: None)
    host = results.host_key()
    if host is None:
        raise RuntimeError(
            "no npu device here: the selftest runs on an Ascend host with torch_npu and CANN installed "
            "(`python -m npu_hub_kernels doctor` says what this host has)"
        )
    started = time.time()
    selected = list(CARDS.values()) if cards is None else cards
    widths = model_widths(model)[: 1 if quick else None]
    tokens = TOKENS[:1] if quick else TOKENS
    repeats = REPEATS[quick]
    on_emulation = emulated()
    estimate = estimate_a2_seconds(selected, widths, tokens, repeats)
    say(f"selftest of {len(selected)} cards on {host['device']} (CANN {host['cann']}, torch_npu {host['torch_npu']})")
    say(f"models: {', '.join(w.model for w in widths)}; tokens {', '.join(map(str, tokens))}; "
        f"estimated on an Atlas A2: about {estimate:.0f} s")  # fmt: skip
    report: dict[str, Any] = {
        "schema": results.SCHEMA,
        "started": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
        "quick": quick,
        "models": [{**w.__dict__, "tokens": list(tokens)} for w in widths],
        "tokens": list(tokens),
        "emulation": EMULATION_NOTE if on_emulation else None,
        "host": host,
        "environment": environment(),
        "estimate_a2_seconds": round(estimate, 1),
        "cards": {},
    }
    for number, card in enumerate(selected, 1):
        say(f"[{number}/{len(selected)}] {card.repo_name}")
        report["cards"][card.repo_name] = _card_report(
            card, org=resolve_org(org), version=version, local_dir=local_dir, widths=widths, tokens=tokens,
            repeats=repeats, on_emulation=on_emulation, say=say,
        )  # fmt: skip
    report["seconds"] = round(time.time() - started, 1)
    report["verdict"] = results.worst_verdict(card["verdict"] for card in report["cards"].values())
    return report


def estimate_a2_seconds(cards: list[Card], widths: list[Widths], tokens: tuple[int, ...], repeats: int) -> float:
    """The selftest's time on an Atlas A2, estimated from the calls it makes (see the A2_SECONDS_* constants)."""
    total = 0.0
    for card in cards:
        module = cases_of(card)
        card_forms = getattr(module, "FORMS", {})
        for form in card_forms.values():
            for shape in {form.at(w.with_tokens(count)) for w in widths if form.applies(w) for count in tokens}:
                judgement = A2_SECONDS_PER_JUDGEMENT + form.flops(shape) / HOST_FLOPS
                total += len(form.dtypes) * judgement + 2 * (repeats + 1) * A2_SECONDS_PER_TIMED_CALL / len(tokens)
        probes = 2 * len(getattr(module, "CASES", {})) + len(getattr(module, "LIMITS", {}))
        total += probes * A2_SECONDS_PER_PROBE
    return total


def emulation_divisor(form: Form, widths: Widths) -> int:
    """The power of two the emulation divides `widths` by for `form` (`Widths.narrowed`); 1 where its matmuls are few.

    The least that brings the form's matmuls to `EMULATION_FLOPS`, or past which narrowing shrinks them no further
    (attention's depend on heads and tokens only).
    """
    divisor, flops = 1, form.flops(form.at(widths))
    while flops > EMULATION_FLOPS:
        narrower = form.flops(form.at(widths.narrowed(2 * divisor)))
        if narrower >= flops:
            break
        divisor, flops = 2 * divisor, narrower
    return divisor


def _card_report(
    card: Card, *, org, version, local_dir, widths, tokens, repeats, on_emulation: bool, say: Progress
) -> dict[str, Any]:
    """One card: loaded as the loader loads it, its forms judged and timed, its probes and limits run."""
    entry: dict[str, Any] = {"kernel_id": card.kernel_id, "version": version, "forms": [], "timings": [],
                             "probes": [], "limits": [], "failed": {}, "not_run": None}  # fmt: skip
    module = cases_of(card)
    card_forms: dict[str, Form] = getattr(module, "FORMS", {})
    try:
        loaded = _load(card, org=org, version=version, local_dir=local_dir)
    except Exception as error:  # the doctor says why in detail; the selftest records it and goes on
        entry.update(variant=None, digest=None, problem=_one_line(error), verdict="not loaded")
        say(f"    not loaded: {entry['problem']}")
        loaded = None
    if loaded is not None:
        entry.update(variant=loaded.VARIANT, digest=results.variant_digest(Path(loaded.__file__).parent.parent))
        entry["problem"] = None
        for name, form in card_forms.items():
            _judge_form(loaded, name, form, widths, tokens, repeats, on_emulation, entry, say)
        entry["limits"] = [_limit(name, make, loaded) for name, make in getattr(module, "LIMITS", {}).items()]
    entry["probes"] = [_probe(rule, *calls) for rule, calls in getattr(module, "CASES", {}).items()]
    for probe in entry["probes"]:
        if probe["finding"]:
            say(f"    {probe['finding']}: {probe['rule']}")
    entry["judged_forms"] = len({row["form"] for row in entry["forms"] if row["status"] in JUDGED})
    entry["card_forms"] = len(card_forms)
    if loaded is not None:
        entry["verdict"] = _verdict(entry)
    if entry["verdict"] == results.NOT_RUN:
        entry["not_run"] = _why_not_run(card_forms, widths, entry["forms"])
    entry["judged_at"] = datetime.now(UTC).isoformat(timespec="microseconds")
    say(f"    {entry['verdict']}" + (f": {entry['not_run']}" if entry["not_run"] else ""))
    return entry


def _judge_form(card_module, name, form: Form, widths, tokens, repeats, on_emulation, entry, say: Progress) -> None:
    """Judge `form` in each of its dtypes at each model's widths and token count, and time it once per model."""
    layers = list(ALL_LAYERS if form.layers == ALL_LAYERS else form.layers)
    for width in widths:
        if not form.applies(width):
            continue
        shapes = _shapes(form, width, tokens, on_emulation)
        fused_here = None
        for shape, divisor in shapes:
            for dtype in form.dtypes:
                judged = forms.judge(card_module, form, shape, dtype, "npu")
                dtype_name = str(dtype).removeprefix("torch.")
                entry["forms"].append({
                    "form": name, "layers": layers, "model": width.model, "tokens": shape.tokens, "dtype": dtype_name,
                    "emulation_widths": _emulation_widths(shape, divisor), "status": judged.status,
                    "reason": judged.reason, "worst": judged.worst,
                    "errors": {k: [e if math.isfinite(e) else None for e in v] for k, v in judged.errors.items()},
                })  # fmt: skip
                where = f", {width.model}" if len(widths) > 1 else ""
                narrowed = f" at 1/{divisor} of its widths" if divisor > 1 else ""
                say(f"    {name}, {dtype_name}, {shape.tokens} tokens{where}{narrowed}: {judged.status}"
                    + (f" ({judged.reason or judged.worst})" if judged.status != "pass" else ""))  # fmt: skip
                if judged.status in ("fail", "error") and name not in entry["failed"]:
                    why = judged.worst if judged.status == "fail" else f"the fused call raised {judged.reason}"
                    entry["failed"][name] = {
                        "layers": layers,
                        "why": f"{dtype_name}, {shape.tokens} tokens at {width.model}'s widths{narrowed}: {why}",
                    }
                if judged.status in ("pass", "fail") and fused_here is None:
                    fused_here = dtype
        if fused_here is not None:
            timed, divisor = shapes[-1]
            fused_ms, eager_ms = forms.time_form(card_module, form, timed, fused_here, "npu", repeats)
            entry["timings"].append({
                "form": name, "model": width.model, "tokens": timed.tokens,
                "dtype": str(fused_here).removeprefix("torch."),
                "emulation_widths": _emulation_widths(timed, divisor),
                "fused_ms": round(fused_ms, 3), "eager_ms": round(eager_ms, 3),
            })  # fmt: skip


def _shapes(form: Form, width: Widths, tokens: tuple[int, ...], on_emulation: bool) -> list[tuple[Widths, int]]:
    """The widths `form` runs at for one model at each token count, fewest tokens first, without repeats.

    Each comes with the divisor of the model's widths: 1 but where the emulation narrows them (`emulation_divisor`).
    """
    shapes: dict[Widths, int] = {}
    for count in tokens:
        at_count = width.with_tokens(count)
        divisor = emulation_divisor(form, at_count) if on_emulation else 1
        shapes.setdefault(form.at(at_count.narrowed(divisor)), divisor)
    return sorted(shapes.items(), key=lambda item: item[0].tokens)


def _emulation_widths(shape: Widths, divisor: int) -> dict[str, int] | None:
    """The narrowed widths a form ran at on the emulation (the report's `emulation_widths`), None at the model's."""
    return {"divisor": divisor, **{name: getattr(shape, name) for name in NARROWED}} if divisor > 1 else None


def _why_not_run(card_forms: dict[str, Form], widths: list[Widths], rows: list[dict[str, Any]]) -> str:
    """Why no form of the card was judged: the run's widths, and whether each form has no region there or ran eager."""
    forms_by_why: dict[str, list[str]] = {}
    for name in card_forms:
        eager = next((row["reason"] for row in rows if row["form"] == name), None)
        forms_by_why.setdefault(f"eager ({eager})" if eager else "no such region at these widths", []).append(name)
    whys = "; ".join(f"{', '.join(names)}: {why}" for why, names in forms_by_why.items())
    return f"no form judged at {'; '.join(map(_described, widths))}: {whys}"


def _described(widths: Widths) -> str:
    """A model's name and the widths that decide which forms apply."""
    return (f"{widths.model} (hidden {widths.hidden}, intermediate {widths.intermediate}, {widths.heads} / "
            f"{widths.kv_heads} heads of {widths.head_dim}, vocabulary {widths.vocab}, {widths.experts} experts, "
            f"top-k {widths.top_k})")  # fmt: skip


def _probe(rule: str, accepted: Callable[[], Any], refused: Callable[[], Any]) -> dict[str, Any]:
    """Run one call the ledger accepts and one it refuses: what the device did with each, and any disagreement."""
    inside, past = _outcome(accepted), _outcome(refused)
    finding = None
    if inside.startswith("raised"):
        finding = "bug: the device refuses a call the ledger accepts"
    elif past == "accepted":
        finding = "finding: the device accepts a call the ledger refuses"
    return {"rule": rule, "inside": inside, "past": past, "finding": finding}


def _outcome(call: Callable[[], Any]) -> str:
    try:
        call()
        _synchronize()
    except NotRunHere as reason:
        return f"not run: {reason}"
    except Exception as error:  # what the device says is the probe's result
        return f"raised {_one_line(error)}"
    return "accepted"


def _limit(name: str, make: Callable, card_module: ModuleType) -> dict[str, Any]:
    """The card at or just past a limit: whether it fused (its reason), and whether the device took its calls."""
    try:
        run, reason = make(card_module)
        why = reason()
        run()
        _synchronize()
    except NotRunHere as error:
        return {"limit": name, "outcome": f"not run: {error}", "finding": None}
    except Exception as error:  # a card that sends the device what it refuses: a bug to report
        return {"limit": name, "outcome": f"raised {_one_line(error)}", "finding": "bug: the card's call raised"}
    return {"limit": name, "outcome": "fused" if why is None else f"eager: {why}", "finding": None}


TO_REPORT = ("findings", "bugs", "fail", "not loaded")
"""The card verdicts worth an issue (`results.VERDICTS` says what each means)."""


def _verdict(entry: dict[str, Any]) -> str:
    """A loaded card's verdict (`results.VERDICTS`): what its forms, probes and limits found.

    `not run` if no form was judged (then its bugs are in its probes and limits, and the exit status, but not its
    verdict)."""
    findings = [item["finding"] or "" for item in entry["probes"] + entry["limits"]]
    if entry["failed"]:
        return "fail"
    if not entry["judged_forms"]:  # before bugs: an entry that judged no form must not wipe a kept verdict
        return results.NOT_RUN
    if any(finding.startswith("bug") for finding in findings):
        return "bugs"
    return "findings" if any(findings) else "pass"


def format_table(report: dict[str, Any]) -> str:
    """The report for people: the host, one row per card, then what failed, what was not run and what to send."""
    env = report["environment"]
    lines = [
        f"npu-hub-kernels selftest: {env['device']} x{env['device_count']}, CANN {env['cann']}, torch {env['torch']}, "
        f"torch_npu {env['torch_npu']}, driver {env['driver']}",
        f"models {', '.join(m['model'] for m in report['models'])}; tokens {', '.join(map(str, report['tokens']))}; "
        f"{report['seconds']} s (estimated on an Atlas A2: {report['estimate_a2_seconds']} s)",
        *([f"emulation: {report['emulation']}"] if report["emulation"] else []),
        "",
        f"{'card':<26} {'verdict':<10} {'forms judged':<13} {'pass/fail/eager':<16} {'probes':<14} "
        f"{'fused/eager ms':<16} variant",
    ]
    for name, card in report["cards"].items():
        statuses = [form["status"] for form in card["forms"]]
        judged = f"{card['judged_forms']} of {card['card_forms']}"
        counts = (f"{statuses.count('pass')}/{statuses.count('fail') + statuses.count('error')}/"
                  f"{statuses.count('eager')}")  # fmt: skip
        odd = sum(bool(probe["finding"]) for probe in card["probes"])
        probes = f"{len(card['probes'])}, {odd} odd" if card["probes"] else "-"
        timed = card["timings"][0] if card["timings"] else None
        times = f"{timed['fused_ms']:.2f}/{timed['eager_ms']:.2f}" if timed else "-"
        lines.append(f"{name:<26} {card['verdict']:<10} {judged:<13} {counts:<16} {probes:<14} {times:<16} "
                     f"{card['variant']}")  # fmt: skip
    for name, card in report["cards"].items():
        for form, failure in card["failed"].items():
            lines.append(f"  {name}: {form} stands down: {failure['why']}")
        if card.get("problem"):
            lines.append(f"  {name}: not loaded: {card['problem']}")
        if card["not_run"]:
            lines.append(f"  {name}: not run: {card['not_run']}")
        for item in card["probes"] + card["limits"]:
            if item["finding"]:
                lines.append(f"  {name}: {item['finding']}: {item.get('rule') or item.get('limit')}")
        narrowed: dict[tuple[str, str], dict[int, int]] = {}
        for row in card["forms"]:
            if row["emulation_widths"]:
                narrowed.setdefault((row["form"], row["model"]), {})[row["tokens"]] = row["emulation_widths"]["divisor"]
        for (form, model), divisors in narrowed.items():
            at = ", ".join(f"1/{divisor} ({tokens} tokens)" for tokens, divisor in divisors.items())
            lines.append(f"  {name}: {form} ran on the emulation at {at} of {model}'s widths")
    lines += ["", f"verdict: {report['verdict']}"]
    if any(card["verdict"] in TO_REPORT for card in report["cards"].values()):
        lines.append("Please open an issue with the JSON report attached (--json PATH) and the doctor's output.")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The selftest's command-line options."""
    from ..doctor import _version_argument, org_argument

    parser.add_argument("--model", help="a model folder or Hub id: its config.json's widths (no weights)")
    parser.add_argument("--quick", action="store_true", help="one model, one token count, fewer timed repeats")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the report as JSON (docs/selftest.md)")
    parser.add_argument("--org", type=org_argument, help="Hub organisation of the cards (as the doctor's)")
    parser.add_argument("--version", type=_version_argument, default=1, help="card API version (default: 1)")
    parser.add_argument("--local-dir", type=Path, help="load the built cards of this folder (make build's build/)")
    parser.add_argument("--cards", help="only these cards: kernel ids or card names, comma-separated")
    parser.add_argument("--no-record", action="store_true",
                        help="do not keep the result for register_npu_kernels() (no card stands down)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    """Check the paths, run the selftest, print the table, keep the result, write the report: the exit status.

    Progress goes to stderr; the exit status is the module's (docstring).
    """
    cards = None
    if args.cards:
        by_name = {**CARDS, **{card.repo_name: card for card in CARDS.values()}}
        unknown = [name for name in args.cards.split(",") if name.strip() not in by_name]
        if unknown:
            print(f"error: unknown cards {unknown}; pass kernel ids or card names of: {', '.join(by_name)}",
                  file=sys.stderr)  # fmt: skip
            return 2
        cards = [by_name[name.strip()] for name in args.cards.split(",")]
    if args.model is not None and (why := _model_problem(args.model)):
        print(f"error: --model {args.model}: {why}; pass a model folder holding a config.json, or a Hub model id",
              file=sys.stderr)  # fmt: skip
        return 2
    unwritable = _unwritable(args)
    for problem in unwritable:
        print(f"error: {problem}", file=sys.stderr)
    if unwritable:
        return 2
    try:
        report = run_selftest(
            model=args.model, quick=args.quick, org=args.org, version=args.version, local_dir=args.local_dir,
            cards=cards, progress=lambda line: _print(line, sys.stderr),
        )  # fmt: skip
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    written, where = _written(report, args)  # before printing: a broken stdout must not lose the report
    _print(format_table(report))
    for line in where:
        _print(line)
    if not written:
        return 2
    if report["cards"] and all(card["verdict"] == "not loaded" for card in report["cards"].values()):
        _print("error: no card loaded on this host, so nothing was judged; `python -m npu_hub_kernels doctor` says why",
               sys.stderr)  # fmt: skip
        return 2
    return 1 if any(card["verdict"] in ("fail", "bugs") or _bugs(card) for card in report["cards"].values()) else 0


def _bugs(card: dict[str, Any]) -> bool:
    """Whether the device refused a call the ledger accepts (or a call at a limit raised) for this card."""
    return any((item.get("finding") or "").startswith("bug") for item in card["probes"] + card["limits"])


def _model_problem(model: str) -> str | None:
    """Why `model`'s widths cannot be read (no such folder or Hub model, or not a model config), or None."""
    try:
        model_widths(model)
    except Exception as error:  # AutoConfig's OSError, ValueError; AttributeError for a config without widths
        where = "is not a model config" if Path(model).exists() else "is neither a folder nor a model on the Hub"
        return f"{where} ({_one_line(error)})"
    return None


def _unwritable(args: argparse.Namespace) -> list[str]:
    """One line for each path the run would write and cannot: which, why, and what to do. Asked before the run."""
    problems = []
    if args.json is not None and _is_kept_file(args.json):
        problems.append(f"cannot write the report to {args.json}: it is where this host's result is kept; pass --json "
                        "a file outside the results folder")  # fmt: skip
    elif args.json is not None and (why := _report_problem(args.json)):
        problems.append(f"cannot write the report to {args.json}: {why}; pass --json a file in a folder you can write")
    if not args.no_record and (why := results.results_dir_problem(_host())):
        origin = f"${results.DIR_ENV}" if os.environ.get(results.DIR_ENV) else "under HF_HOME"
        problems.append(
            f"cannot keep this host's result in {results.results_dir()} ({origin}): {why}; make it writable, set "
            f"{results.DIR_ENV} to a folder you can write, or pass --no-record"
        )
    return problems


def _host() -> dict[str, str] | None:
    """This host's identity for its result, None when it has no npu device (the run then says so) or it is unknown."""
    try:
        return results.host_key()
    except Exception:  # a broken torch_npu: the run reports it
        return None


def _is_kept_file(path: Path) -> bool:
    """Whether `path` is a kept result (or its lock or a partial write of one) in the results folder."""
    if os.path.realpath(path.parent) != os.path.realpath(results.results_dir()):
        return False
    return path.name.startswith(("result-", ".result-")) and path.suffix in (".json", ".lock", ".partial")


def _report_problem(path: Path) -> str | None:
    """Why the report could not be written to `path`, or None: opened to append (a new file is removed again)."""
    if path.is_dir():
        return "it is a folder"
    if not path.parent.is_dir():
        return f"{path.parent} is not a folder" if path.parent.exists() else f"the folder {path.parent} does not exist"
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as error:
        return results.os_reason(error)
    if not existed:
        path.unlink()
    if _special(path):
        return None
    try:  # the report is written to a temporary file beside it, then renamed over it
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
            pass
    except OSError as error:
        return results.os_reason(error)
    return None


def _special(path: Path) -> bool:
    """Whether `path` is a file that is not a regular one (/dev/stdout, a pipe): written in place, not replaced."""
    return path.exists() and not path.is_file()


def _write_report(path: Path, text: str) -> None:
    """Write the report atomically: a failed write leaves no truncated file and keeps the report that was there."""
    if _special(path):
        path.write_text(text)
    else:
        results._write_atomically(path, text)


def _print(text: str, stream: Any = None) -> None:
    """Print `text` to `stream` (stdout), never fatally.

    A closed pipe (`| head`) silences the stream from then on, and characters its encoding lacks are escaped."""
    stream = stream or sys.stdout
    try:
        try:
            print(text, file=stream, flush=True)
        except UnicodeEncodeError:
            encoding = getattr(stream, "encoding", None) or "ascii"
            print(text.encode(encoding, "backslashreplace").decode(encoding), file=stream, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
        with contextlib.suppress(OSError, ValueError, AttributeError):  # the rest, and the flush at exit, go nowhere
            os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())


def _written(report: dict[str, Any], args: argparse.Namespace) -> tuple[bool, list[str]]:
    """Keep the result for this host, then write the report (`--json`): whether both were written, and where.

    The lines that say where are for stdout, after the table. The result goes first: it is what stands failed forms down
    on this host. A write that fails (the disk filled during the run) is said in one line on stderr, with what was kept
    where.
    """
    kept, written, where = None, True, []
    if not args.no_record:
        try:
            kept = results.save_result(report)
        except OSError as error:
            _print(f"error: could not keep this host's result in {results.results_dir()}: {results.os_reason(error)}; "
                   "no form stands down here until a run keeps it", sys.stderr)  # fmt: skip
            written = False
        else:
            where.append(f"kept for register_npu_kernels(): {kept}")
    if args.json is not None:
        try:
            _write_report(args.json, json.dumps(report, indent=2))
        except OSError as error:
            elsewhere = (f"this host's result is kept in {kept} (the report's cards, with earlier runs' other cards): "
                         "attach that file instead" if kept else "the result was not kept either")  # fmt: skip
            _print(f"error: could not write the report to {args.json}: {results.os_reason(error)}; {elsewhere}",
                   sys.stderr)  # fmt: skip
            written = False
        else:
            where.append(f"report: {args.json}")
    return written, where


def _load(card: Card, *, org: str, version: int, local_dir: str | Path | None) -> ModuleType:
    """The card's build as the loader picks it for this host (kernels' get_local_kernel or get_kernel)."""
    from kernels import get_kernel, get_local_kernel

    if local_dir is not None:
        return get_local_kernel(Path(local_dir) / card.repo_name, trust_remote_code=True)
    return get_kernel(card.repo_id(org), version=version, trust_remote_code=[card.repo_id(org)])


def _synchronize() -> None:
    torch.npu.synchronize()


def _driver_version() -> str:
    """The Ascend driver's version from its install record (version.info), or why it is unknown."""
    record = Path("/usr/local/Ascend/driver/version.info")
    try:
        lines = record.read_text().splitlines()
    except OSError:
        return f"unknown (no {record})"
    return next((line.partition("=")[2].strip() for line in lines if line.startswith("Version=")), "unknown")


def _version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0][:300]}" if text else type(error).__name__
