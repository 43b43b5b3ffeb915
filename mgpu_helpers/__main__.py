"""``python -m mgpu_helpers``: the environment doctor.

Prints what this machine has and what the workbook will do on it; ``--json`` prints
the same report as JSON for scripts and bug reports.
"""

from __future__ import annotations

import argparse
import json

from .runtime.env import describe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mgpu_helpers",
        description="Report Python, PyTorch, CUDA, GPUs and how the workbook will run here.",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    report = describe()
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
