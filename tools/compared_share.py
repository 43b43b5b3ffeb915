"""How much of each chapter does nbval really compare?

A code cell tagged ``nbval-ignore-output`` is still executed, but its output is not
compared with the stored one; ``nbval-skip`` is not even run. This prints, per chapter
and in total, how many code cells are compared, and with ``--min`` fails when the total
share is below a threshold.

    python tools/compared_share.py              # the table
    python tools/compared_share.py --min 0.8    # exit 1 below 80%
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOT_COMPARED = ("nbval-ignore-output", "nbval-skip")


def count(path: Path) -> tuple[int, int]:
    """(code cells, code cells whose output nbval compares) of one notebook."""
    cells = [c for c in json.loads(Path(path).read_text())["cells"] if c["cell_type"] == "code"]
    compared = [c for c in cells
                if not set(c.get("metadata", {}).get("tags", [])) & set(NOT_COMPARED)]
    return len(cells), len(compared)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="default: every chapter in notebooks/")
    parser.add_argument("--min", type=float, default=None,
                        help="fail when the total compared share is below this (0 to 1)")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    total_cells = total_compared = 0
    width = max(len(p.stem) for p in paths)
    for path in paths:
        cells, compared = count(path)
        total_cells += cells
        total_compared += compared
        print(f"{path.stem:<{width}}  {compared:>3} of {cells:>3} code cells compared "
              f"({compared / cells:.0%})")
    share = total_compared / total_cells
    print(f"{'all chapters':<{width}}  {total_compared:>3} of {total_cells:>3} code cells "
          f"compared ({share:.0%})")
    if args.min is not None and share < args.min:
        print(f"below the required {args.min:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
