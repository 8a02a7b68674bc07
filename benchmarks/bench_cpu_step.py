"""CPU time of scheduling + input preparation per decode step, and Request construction.

Same as ``backplane bench cpu``; see :mod:`backplane.cli.bench.cpu` for what is measured.
"""

from __future__ import annotations

import argparse

from backplane.cli.bench.cpu import add_arguments, run_cpu


def main(argv: list[str] | None = None) -> int:
    """Parse the flags and run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    run_cpu(device=args.device, steps=args.steps, as_json=args.json, quick=args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
