"""Merge the per-W reports of `benchmarks/device/aegis_scaling.sh` into one (scaling
efficiency against the W = 1 run), print the table and draw the figure.

    python benchmarks/device/merge_aegis.py OUT/aegis_W*.json --out merged.json --plot merged.png
"""

import argparse
import json
from pathlib import Path

from cipherlm.bench import aegis


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--out")
    ap.add_argument("--plot")
    args = ap.parse_args()
    reports = [json.loads(Path(p).read_text()) for p in args.reports]
    # a `--report` file holds the bench's result under extra.aegis, beside the machine
    res = aegis.merge([r["extra"]["aegis"] if "extra" in r else r for r in reports])
    res["machines"] = [r.get("machine") for r in reports]
    print(aegis.table(res))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    if args.plot:
        aegis.plot(res, args.plot)


if __name__ == "__main__":
    main()
