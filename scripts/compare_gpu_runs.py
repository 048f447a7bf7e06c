#!/usr/bin/env python
"""bench_gpu results files from several runs (machines) side by side: what each machine was (board, ceilings,
clocks while the engine ran) and every stable figure with its median, spread and issue 19's target judged on the
median. Reads JSON only (no MLX or torch).

    python3 scripts/compare_gpu_runs.py benchmarks/results/NVIDIA-H100-*-L28-V32.json [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib.gpu_targets import compare, machine, tables  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench_gpu results files")
    parser.add_argument("--json", type=Path, help="also write the comparison here")
    args = parser.parse_args(argv)
    reports, names = [], []
    for path in args.runs:
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            parser.error(f"{path}: not a readable results file ({err})")
        if "figures" not in report:
            parser.error(f"{path}: no `figures` (a partial file, or not bench_gpu's); pass the run's final file")
        reports.append(report)
        names.append(path.stem)
    print(tables(names, reports))
    if args.json:
        args.json.write_text(json.dumps({"runs": [str(p) for p in args.runs],
                                         "machines": [machine(r) for r in reports],
                                         "figures": compare(reports)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
