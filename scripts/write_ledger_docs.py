"""Rewrite the constraint ledger's section of docs/torch-npu-ops.md from the emulated ops' rules (`make ledger`).

    python scripts/write_ledger_docs.py [--docs docs/torch-npu-ops.md] [--check]

The section lies between `<!-- ledger:begin -->` and `<!-- ledger:end -->`; nothing there is written by hand.
With --check it writes nothing and exits 1 when the section differs from the ledger (tests/test_ledger.py checks it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from npu_hub_kernels.testing.emulation import LEDGER
from npu_hub_kernels.testing.emulation.ledger import render_markdown

BEGIN, END = "<!-- ledger:begin -->", "<!-- ledger:end -->"
DOCS = Path(__file__).resolve().parent.parent / "docs" / "torch-npu-ops.md"


def with_ledger(text: str) -> str:
    """`text` (the docs page) with its ledger section rendered from LEDGER."""
    head, begin, rest = text.partition(BEGIN)
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"the page has no {BEGIN} ... {END} section")
    return f"{head}{BEGIN}\n{render_markdown(LEDGER)}{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--check", action="store_true", help="exit 1 when the section is out of date; write nothing")
    args = parser.parse_args(argv)
    text = args.docs.read_text()
    new = with_ledger(text)
    if args.check:
        if new != text:
            print(f"{args.docs}: the ledger section is out of date: run `make ledger`", file=sys.stderr)
            return 1
        return 0
    args.docs.write_text(new)
    print(f"{args.docs}: ledger section written ({len(LEDGER)} rules)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
