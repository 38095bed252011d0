"""Honest drift of a real run, per engine and staleness: the sampling checks' evidence and allowances (#23).

Every trainer step records, in its metrics (`calibration`), what its checks saw per `engine/staleness`
(groups, logprob gap, raw z and the drift-corrected, engine-centred z_adj, rejections by the derived
allowances and by the fixed floors alone) and the allowances it judged with (the gap bound per staleness,
the drift its probe measured). This sums them over a run and prints the table docs/security.md quotes:

    python benchmarks/bench_honest_drift.py runs/<name>            # a `pnyx run` folder (its store)
    python benchmarks/bench_honest_drift.py s3://bucket/run --from 2

Run it on runs whose workers are honest (your own `pnyx run`): every rejection it shows is a false
positive. `--json` writes the same figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any


def collect(store_url: str, first: int = 1) -> tuple[dict[str, dict[str, float]], dict[str, Any], int]:
    """(per `engine/staleness` sums over the run's steps, the allowances of the last step, steps read)."""
    from pnyx.store import open_store
    from pnyx.train.checkpoint import read_metrics

    store = open_store(store_url)
    sums: dict[str, dict[str, float]] = {}
    bounds: dict[str, list[list[float]]] = {}
    last: dict[str, Any] = {}
    steps = 0
    for m in read_metrics(store):
        c = m.get("calibration")
        if not c or m.get("version", 0) < first:
            continue
        steps += 1
        last = c
        for e, b in (c.get("lp_gap_bound") or {}).items():
            bounds.setdefault(e, []).append(b)
        for k, b in (c.get("groups") or {}).items():
            a = sums.setdefault(k, {})
            for f, v in b.items():
                if f.endswith("_min"):
                    a[f] = min(a.get(f, v), v)
                elif f.endswith("_max"):
                    a[f] = max(a.get(f, v), v)
                else:
                    a[f] = a.get(f, 0.0) + v
    last = dict(last)
    last["bound_min"] = {e: [min(col) for col in zip(*bs, strict=False)] for e, bs in bounds.items()}
    return sums, last, steps


def _sd(s: float, sq: float, n: float) -> float:
    return math.sqrt(max(0.0, sq / n - (s / n) ** 2)) if n else float("nan")


def _buckets(sums: dict[str, dict[str, float]], last: dict[str, Any]) -> Any:
    """(engine, staleness, sums, groups, the smallest derived bound any step used there) per bucket."""
    bounds = last.get("bound_min") or {}
    for k in sorted(sums, key=lambda k: (k.split("/")[0], int(k.split("/")[1]))):
        engine, s = k.split("/")
        bmin = bounds.get(engine) or bounds.get("any") or []
        yield engine, int(s), sums[k], sums[k]["n"], bmin[int(s)] if int(s) < len(bmin) else float("nan")


def table(sums: dict[str, dict[str, float]], last: dict[str, Any]) -> list[str]:
    lines = [
        "engine/s  groups  gap_mean  gap_max  bound_min(derived)  floor   z_mean  z_sd   z_min   z_max  "
        "za_mean  za_sd  za_min  za_max  rejected(derived)  kept(exact re-check)  rejected(fixed floors)"
    ]
    for engine, s, b, n, bound in _buckets(sums, last):
        floor = 0.03 + 0.25 * s
        lines.append(
            f"{engine + '/' + str(s):8s}  {int(n):6d}  {b['gap_sum'] / n:8.4f}  {b['gap_max']:7.4f}  {bound:18.4f}  {floor:5.2f}  "
            f"{b['z_sum'] / n:+6.3f}  {_sd(b['z_sum'], b['z_sq'], n):5.3f}  {b['z_min']:+6.2f}  {b['z_max']:+6.2f}  "
            f"{b['za_sum'] / n:+7.3f}  {_sd(b['za_sum'], b['za_sq'], n):5.3f}  {b['za_min']:+6.2f}  {b['za_max']:+6.2f}  "
            f"{int(b['rejects']):6d} ({100 * b['rejects'] / n:.2f}%)  {int(b.get('rejudged', 0)):6d}  "
            f"{int(b['fixed_rejects']):6d} ({100 * b['fixed_rejects'] / n:.2f}%)"
        )
    return lines


def markdown(sums: dict[str, dict[str, float]], last: dict[str, Any]) -> list[str]:
    """The same table as markdown (what docs/security.md quotes)."""
    out = [
        "| engine / staleness | groups | gap mean | gap max | derived bound (min over steps) | fixed floor | z mean "
        "(sd) | z min | centred z mean (sd) | rejected, derived | failed derived, kept by the exact re-check | "
        "rejected, fixed floors |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for engine, s, b, n, bound in _buckets(sums, last):
        out.append(
            f"| {engine} / {s} | {int(n)} | {b['gap_sum'] / n:.4f} | {b['gap_max']:.4f} | {bound:.3f} | "
            f"{0.03 + 0.25 * s:.2f} | {b['z_sum'] / n:+.2f} ({_sd(b['z_sum'], b['z_sq'], n):.2f}) | "
            f"{b['z_min']:+.2f} | {b['za_sum'] / n:+.2f} ({_sd(b['za_sum'], b['za_sq'], n):.2f}) | "
            f"{int(b['rejects'])} ({100 * b['rejects'] / n:.1f}%) | {int(b.get('rejudged', 0))} | "
            f"{int(b['fixed_rejects'])} ({100 * b['fixed_rejects'] / n:.1f}%) |"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stores", nargs="+", help="run stores (a `pnyx run` folder, or a store URL)")
    ap.add_argument("--from", dest="first", type=int, default=1, help="first version counted")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = ap.parse_args()
    out = {}
    for url in args.stores:
        sums, last, steps = collect(url, args.first)
        print(f"\n{url}: {steps} steps with calibration metrics")
        if not sums:
            print("  (no checked groups: were the sampling checks on?)")
            continue
        for line in markdown(sums, last) if args.markdown else table(sums, last):
            print(line if args.markdown else "  " + line)
        print(
            f"  allowances at the last step: drift A(s) {last.get('drift')}, gap bound {last.get('lp_gap_bound')}, "
            f"z centre {last.get('z_center')}"
        )
        out[url] = {"steps": steps, "groups": sums, "last": last}
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
