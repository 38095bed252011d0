"""Of a finished run's generated groups, the share uploaded for training, phase by phase: the groups and skip
records listed under each version (a seeded worker uploads every zero-variance group it does not offer as a
skip record), summed over windows of `--every` versions. How the zero-variance waste moves as the policy
learns (BENCHMARKS.md, "Generated groups the trainer consumes").

    python benchmarks/supply_phases.py runs/<name> [--every 40]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="the run's store (a folder or URL)")
    p.add_argument("--every", type=int, default=40, help="versions per phase")
    args = p.parse_args()
    if args.every < 1:
        sys.exit("--every must be >= 1")
    from pnyx.protocol import layout
    from pnyx.store import open_store

    groups: Counter[int] = Counter()
    skips: Counter[int] = Counter()
    for meta in open_store(args.run).list(layout.ROLLOUTS_PREFIX):
        parsed = layout.parse_rollout_key(meta.key)
        if parsed is None:
            continue
        (skips if layout.is_skip_key(meta.key) else groups)[parsed[0] // args.every] += 1
    if not groups and not skips:
        sys.exit(f"{args.run}: no rollout records listed")
    for phase in sorted(set(groups) | set(skips)):
        n = groups[phase] + skips[phase]
        lo = phase * args.every
        print(
            f"v{lo}-{lo + args.every - 1}: {groups[phase]} groups uploaded, {skips[phase]} skip records, "
            f"uploaded share {groups[phase] / n:.2f}"
        )


if __name__ == "__main__":
    main()
