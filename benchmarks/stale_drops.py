"""Where a finished run's uploaded groups went: each group's age when it landed (the trainer's version at its
upload stamp minus its own), whether a step consumed it and at which staleness, and the versions whose groups
were left unconsumed. Read from the store alone (rollout keys, batch records); groups in the first key
layout (no upload stamp) are not counted. How the last-chance share was chosen (BENCHMARKS.md, "Generated
groups the trainer consumes").

    python benchmarks/stale_drops.py runs/<name> [runs/<other> ...]
"""

from __future__ import annotations

import bisect
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def report(url: str) -> None:
    from pnyx.protocol import layout
    from pnyx.store import open_store
    from pnyx.train.checkpoint import read_batch_record

    store = open_store(url)
    batches = {}
    version = 1
    while (rec := read_batch_record(store, version)) is not None:
        batches[version] = rec
        version += 1
    if not batches:
        sys.exit(f"{url}: no batch records (did the trainer take a step?)")
    versions = sorted(batches)
    times = [batches[v].created_at for v in versions]
    consumed_at = {k: v for v, rec in batches.items() for k in rec.keys}
    arrivals: Counter[tuple[int, bool]] = Counter()  # (age on landing, consumed)
    left: Counter[int] = Counter()
    per_version: Counter[int] = Counter()
    for meta in store.list(layout.ROLLOUTS_PREFIX):
        parsed = layout.parse_rollout_key(meta.key)
        stamp = layout.rollout_stamp(meta.key)
        if parsed is None or stamp is None or layout.is_skip_key(meta.key):
            continue
        v = parsed[0]
        i = bisect.bisect_right(times, stamp / 1000)
        trainer_at = versions[i - 1] if i else 0
        used = meta.key in consumed_at
        arrivals[(trainer_at - v, used)] += 1
        per_version[v] += 1
        if not used:
            left[v] += 1
    total = sum(arrivals.values())
    used = sum(n for (_, u), n in arrivals.items() if u)
    print(f"{url}: {total} groups uploaded, {used} consumed by {len(batches)} steps")
    print("  age on landing: consumed / not")
    for age in sorted({a for a, _ in arrivals}):
        print(f"    {age:3d}: {arrivals[(age, True)]:6d} / {arrivals[(age, False)]}")
    staleness = Counter(  # the step making version v trains at v - 1
        v - 1 - parsed[0]
        for k, v in consumed_at.items()
        if (parsed := layout.parse_rollout_key(k)) is not None
    )
    print("  consumed at staleness:", dict(sorted(staleness.items())))
    print("  versions with groups left unconsumed (left/uploaded):", " ".join(
        f"v{v}:{left[v]}/{per_version[v]}" for v in sorted(left)
    ))  # fmt: skip


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for url in sys.argv[1:]:
        report(url)


if __name__ == "__main__":
    main()
