"""Command line: `kestrel {serve,generate,make-demo-model,bench} ...` (or `python -m kestrel ...`)."""

from __future__ import annotations

import argparse
import sys

from kestrel.cli import add_commands


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kestrel", description="Kestrel LLM inference engine")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return args.handler(args) or 0
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
