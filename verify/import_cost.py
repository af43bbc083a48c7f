"""What `import nf4` and `import reference` cost beyond their dependencies, in fresh interpreters.

    python -m verify.import_cost [--out build/import_cost.json] [--repeats 7]

Each measurement is a new Python process that imports the baseline (torch and triton for nf4,
numpy for reference), then the package, and reports the seconds and the modules the package
added. Medians over the repeats; the JSON carries the environment like every result file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from . import timing

ROOT = Path(__file__).resolve().parent.parent
PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
{baseline}
t1 = time.perf_counter()
before = set(sys.modules)
import {package}
t2 = time.perf_counter()
added = sorted(set(sys.modules) - before)
print(json.dumps({{"baseline_s": t1 - t0, "package_s": t2 - t1, "added": added}}))
"""
CASES = {"nf4": "import torch, triton", "reference": "import numpy"}


def measure(package: str, repeats: int) -> dict:
    """Median seconds of the baseline and of the package on top of it, and the top-level modules it added."""
    runs = []
    for _ in range(repeats):
        code = PROBE.format(baseline=CASES[package], package=package)
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    added = runs[-1]["added"]
    return {"package": package, "baseline": CASES[package], "repeats": repeats,
            "baseline_s": statistics.median(r["baseline_s"] for r in runs),
            "package_s": statistics.median(r["package_s"] for r in runs),
            "package_s_all": [round(r["package_s"], 4) for r in runs],
            "added_modules": len(added), "added_top_level": sorted({m.split(".")[0] for m in added})}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="build/import_cost.json")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    rows = [measure(p, args.repeats) for p in CASES]
    path = timing.write_json(args.out, {"env": timing.environment(), "rows": rows})
    for r in rows:
        mods = ", ".join(r["added_top_level"])
        print(f"import {r['package']:<9} {1000 * r['package_s']:7.1f} ms beyond `{r['baseline']}` "
              f"({1000 * r['baseline_s']:.0f} ms); adds {r['added_modules']} modules: {mods}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
