"""Prove the model tables on the installed transformers and record what was proven, or say where they stand.

    python scripts/model_tables.py test     # run the parity tests as users get the tables: proven classes swapped
    python scripts/model_tables.py prove    # run them with every listed class swapped; record the fingerprint of
                                            # each class that passed every check, for this release
    python scripts/model_tables.py status   # per card: listed, in this release, proven, and each unproven class
    python scripts/model_tables.py docs     # rewrite docs/models.md's table of proven classes (prove does too)

Both run the tests marked `model_tables` (in the files `model_table_tests` finds) in this interpreter's environment
(`make test-transformers` and `make prove-transformers` run them in one environment per admitted release). `prove` reads
the verdict each test gave each class (tests/proof.py) and adds this release to the proven fingerprints of every
listed class (`PROVEN_CLASSES`: the classes a card's layers swap, and an attention card's fused classes) in
`mapping/npu_hub_kernels/models/proven/<card package>.json`, replacing what an earlier proof of the release recorded.
A class that failed any check, or that no test checked, is not recorded: on this release it stays eager, with why.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import transformers

from npu_hub_kernels.cards import CARDS
from npu_hub_kernels.models import PROVEN_CLASSES, fingerprints

ROOT = Path(__file__).resolve().parents[1]
PROVEN_DIR = ROOT / "mapping" / "npu_hub_kernels" / "models" / "proven"
DOCS = ROOT / "docs" / "models.md"
BEGIN, END = "<!-- proven:begin -->", "<!-- proven:end -->"


def model_table_tests(tests: Path = ROOT / "tests") -> tuple[str, ...]:
    """The test files that mark a test `model_tables` (the parity tests), as paths from the folder above `tests`.

    Found by the marker in their syntax tree, not by collecting every test file: the model-table files import only the
    package's own requirements and pytest, so an environment with an older transformers runs them without the other
    dev packages, which the other test files import."""
    files = sorted(tests.glob("test_*.py"))
    return tuple(str(path.relative_to(tests.parent)) for path in files if _marks_model_tables(path))


def _marks_model_tables(path: Path) -> bool:
    """Whether the file uses the marker (`pytest.mark.model_tables`, `mark.model_tables`), not only names it."""
    return any(
        isinstance(node, ast.Attribute) and node.attr == "model_tables" and ast.unparse(node.value).endswith("mark")
        for node in ast.walk(ast.parse(path.read_text()))
    )


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["test", "prove", "status", "docs"])
    parser.add_argument("--workers", default="2", help="pytest-xdist workers for `prove` (default 2)")
    args = parser.parse_args(argv)
    if args.command == "status":
        return status()
    if args.command == "docs":
        write_docs()
        return 0
    if args.command == "test":
        return _pytest(args.workers).returncode
    return prove(args.workers)


def _pytest(workers: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the model-table parity tests in this environment."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "model_tables", "-n", workers]
    print(f"the model tables on transformers {transformers.__version__}: {' '.join(command[1:])}", flush=True)
    return subprocess.run([*command, *model_table_tests()], cwd=ROOT, env=env)


def prove(workers: str) -> int:
    """Run the parity tests in proving mode and record this release's proven fingerprints."""
    release = transformers.__version__
    with tempfile.NamedTemporaryFile("r", suffix=".verdicts") as verdicts:
        run = _pytest(workers, {**os.environ, "NPU_HUB_KERNELS_PROOF": verdicts.name})
        lines = [line.split() for line in verdicts.read().splitlines() if line.strip()]
    failed = {path for path, outcome in lines if outcome == "fail"}
    passed = {path for path, outcome in lines if outcome == "pass"} - failed
    recorded = defaultdict(int)
    for kernel_id, rules in PROVEN_CLASSES.items():
        card = CARDS[kernel_id]
        path_file = PROVEN_DIR / f"{card.python_name}.json"
        proven = _without_release(json.loads(path_file.read_text()) if path_file.exists() else {}, release)
        for rule in rules:
            obj = rule.installed()
            if obj is None:
                continue
            if rule.path not in passed:
                why = "failed a parity check" if rule.path in failed else "no parity test checked it"
                print(f"  not proven on {release}: {rule.path} ({why})")
                continue
            digest = fingerprints.fingerprint(fingerprints.code_of(obj))
            releases = proven.setdefault(rule.path, {}).setdefault(digest, [])
            if release not in releases:
                releases.append(release)
                releases.sort(key=fingerprints.release_key)
            recorded[card.repo_name] += 1
        PROVEN_DIR.mkdir(parents=True, exist_ok=True)
        path_file.write_text(json.dumps(dict(sorted(proven.items())), indent=1, sort_keys=True) + "\n")
    for card, count in sorted(recorded.items()):
        print(f"{card}: {count} classes proven on transformers {release}")
    write_docs()
    if run.returncode not in (0, 1):  # 1: some checks failed, which the verdicts record; anything else is an error
        print(f"pytest exited {run.returncode}: nothing it did not run is proven", file=sys.stderr)
        return run.returncode
    return 0


def proven_table() -> str:
    """The markdown table of docs/models.md: per card, its listed classes and how many are proven on each release."""
    per_card = {}
    for kernel_id, rules in PROVEN_CLASSES.items():
        card = CARDS[kernel_id]
        proven = json.loads((PROVEN_DIR / f"{card.python_name}.json").read_text())
        listed = {rule.path for rule in rules}
        counts: dict[str, int] = defaultdict(int)
        for path, digests in proven.items():
            if path in listed:
                for release in {r for releases in digests.values() for r in releases}:
                    counts[release] += 1
        per_card[card.repo_name] = (len(rules), counts)
    releases = sorted({r for _, counts in per_card.values() for r in counts}, key=fingerprints.release_key)
    lines = [
        "| card | listed | " + " | ".join(f"proven on {r}" for r in releases) + " |",
        "|---|---|" + "---|" * len(releases),
    ]
    for name, (listed, counts) in sorted(per_card.items()):
        lines.append(f"| {name} | {listed} | " + " | ".join(str(counts.get(r, 0)) for r in releases) + " |")
    return "\n".join(lines)


def write_docs() -> None:
    """Rewrite docs/models.md's table of proven classes from the proven files."""
    text = DOCS.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    DOCS.write_text(f"{head}{BEGIN}\n{proven_table()}\n{END}{tail}")


def _without_release(proven: dict, release: str) -> dict:
    """`proven` with `release` taken out of every fingerprint (a proof of a release replaces the one before)."""
    kept: dict = {}
    for path, digests in proven.items():
        for digest, releases in digests.items():
            if others := [r for r in releases if r != release]:
                kept.setdefault(path, {})[digest] = others
    return kept


def status() -> int:
    """Print, per card, how many listed classes this release has and proves, and each unproven one with why."""
    release = transformers.__version__
    unproven_total = 0
    for kernel_id, rules in PROVEN_CLASSES.items():
        card = CARDS[kernel_id]
        present = [(rule, obj) for rule in rules if (obj := rule.installed()) is not None]
        reasons = {
            rule.path: reason
            for rule, obj in present
            if (reason := fingerprints.unproven_reason(card, rule.path, fingerprints.code_of(obj)))
        }
        unproven_total += len(reasons)
        print(
            f"{card.repo_name}: {len(rules)} listed, {len(present)} in transformers {release}, "
            f"{len(present) - len(reasons)} proven"
        )
        for reason in sorted(reasons.values()):
            print(f"  eager: {reason}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
