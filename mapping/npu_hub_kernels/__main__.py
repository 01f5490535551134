"""Command line of npu-hub-kernels: `python -m npu_hub_kernels doctor ...` and `... selftest ...`."""

from __future__ import annotations

import argparse
import sys

from . import doctor
from .selftest import run as selftest


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run the subcommand and return its exit status."""
    parser = argparse.ArgumentParser(prog="python -m npu_hub_kernels", description="npu-hub-kernels tools")
    commands = parser.add_subparsers(dest="command", required=True)
    doctor.add_arguments(
        commands.add_parser(
            "doctor",
            help="which build variant of each card this machine would load, and why",
            description=doctor.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    selftest.add_arguments(
        commands.add_parser(
            "selftest",
            help="the cards against their eager math on this host's npu device, and a report to send",
            description=selftest.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
    )
    args = parser.parse_args(argv)
    return selftest.run(args) if args.command == "selftest" else doctor.run(args)


if __name__ == "__main__":
    sys.exit(main())
