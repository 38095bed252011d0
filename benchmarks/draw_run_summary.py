"""The check of seeded draws over a finished run, from the trainer's per-step metrics (`draws`): rows
measured, rows flagged by the step's forward (per staleness), passing stale rows audited at random
(`security.stale_draw_audit`), rows failed, the check's seconds (the exact
re-checks, the distances computed inside the step's own forward, and the exact check of skip records' draws,
`skip_audit`: `s` on the step's path, `idle_s` in time the trainer waited for groups, since 2026-12-05 evening;
before, all of it on the path) against the steps' own seconds, the stale rows measured exactly while the trainer
waited (`precheck`, since 2026-12-06: rows, seconds, and the rows the steps' exact re-checks read from them), the skip
records checked on the trainer's background thread while its steps trained (`checks_background`, a running total,
since 2026-12-06 morning: off the path; and the stale rows of the prefetcher's forecast of the next batch measured
there, `pre_*`) with the steps' training throughput beside it (median `tok_s`: what the
thread's use of a core cost the step), the drift probe's seconds beside them (`probe_s`:
the statistical checks' calibration, not a draw check), the groups the steps rejected by reason and the last
step's drops; then the skip records' audit by thirds of the run (records and rows checked per step, their
share of step time on the path and in the wait), which follows the share of zero-variance groups; and the
share on the path of the steps that found a full batch at once against those that waited for groups.

    python benchmarks/draw_run_summary.py runs/<name>
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AT_ONCE_S = 1.5
"""A step whose trainer waited less than this for its batch found it full at once."""
sys.path.insert(0, str(REPO))


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    from pnyx.store import open_store
    from pnyx.train.checkpoint import read_metrics

    metrics = read_metrics(open_store(sys.argv[1]))
    checked = [m for m in metrics if m.get("draws")]
    if not checked:
        sys.exit(f"{sys.argv[1]}: no step checked seeded draws")
    total = Counter()
    by_staleness: dict[str, list[int]] = {}
    for m in checked:
        d = m["draws"]
        for k in ("rows", "flagged", "failed", "dropped"):
            total[k] += d[k]
        total["audited"] += d.get("audited", 0)  # recorded since the stale draw audit (2026-12-05)
        total["exact_s"] += d["exact_s"]
        total["forward_s"] += d.get("forward_s", 0.0)  # recorded since the exact re-check shares prompts
        total["step_s"] += m["step_s"]
        audit = m.get("skip_audit") or {}
        total["skip_s"] += audit.get("s", 0.0)
        total["idle_s"] += audit.get("idle_s", 0.0)
        total["wait_s"] += m.get("ingest_wait_s", 0.0)
        total["records"] += audit.get("groups", 0)
        total["records_idle"] += audit.get("idle_groups", 0)
        total["records_rows"] += audit.get("rows", 0)
        total["at_once"] += m.get("ingest_wait_s", 0.0) < AT_ONCE_S
        total["probe_s"] += m.get("probe_s", 0.0)
        pre = m.get("precheck") or {}
        total["pre_rows"] += pre.get("rows", 0)
        total["pre_s"] += pre.get("s", 0.0)
        total["pre_known"] += pre.get("known", 0)
        for s, row in d["by_staleness"].items():
            acc = by_staleness.setdefault(s, [0, 0, 0])
            for i, x in enumerate(row):
                acc[i] += x
    rejected = Counter()
    for m in metrics:
        rejected.update(m["rejected"])
    step, exact, fwd = total["step_s"], total["exact_s"], total["forward_s"]
    skip, probe, idle = total["skip_s"], total["probe_s"], total["idle_s"]
    print(
        f"{len(checked)} of {len(metrics)} steps checked draws: rows {total['rows']}, flagged {total['flagged']}, "
        f"stale rows audited {total['audited']}, failed {total['failed']}, groups dropped {total['dropped']}; of {step:.2f} s of step time, exact "
        f"re-checks {exact:.2f} s ({100 * exact / step:.1f}%) + distances in the step's forward {fwd:.2f} s "
        f"({100 * fwd / step:.1f}%) + skip records' draws on the step's path {skip:.2f} s "
        f"({100 * skip / step:.1f}%) = {100 * (exact + fwd + skip) / step:.1f}% on the path; skip records' draws "
        f"checked while waiting for groups {idle:.2f} s ({100 * idle / step:.1f}%; the trainer waited "
        f"{total['wait_s']:.2f} s in all); beside them the drift probe {probe:.2f} s ({100 * probe / step:.1f}%)"
    )
    print(
        f"skip records checked {total['records']} ({total['records_rows']} rows): {total['records_idle']} while "
        f"waiting, {total['records'] - total['records_idle']} on the path; a full batch at once (the trainer "
        f"waited under {AT_ONCE_S} s, its check of skip records included) in {total['at_once']} of {len(checked)} steps"
    )
    print(
        f"stale rows measured exactly while waiting for groups {total['pre_rows']} in {total['pre_s']:.2f} s "
        f"({100 * total['pre_s'] / step:.1f}% of step time, off the path); the steps' exact re-checks read "
        f"{total['pre_known']} rows from them (of {total['flagged'] + total['audited']} flagged or audited)"
    )
    bg = metrics[-1].get("checks_background") or {}
    tok_s = sorted(m["tok_s"] for m in checked if m.get("tok_s"))
    print(
        f"skip records checked on the background thread while steps trained {bg.get('groups', 0)} "
        f"({bg.get('rows', 0)} rows, false {bg.get('false', 0)}) in {bg.get('s', 0.0):.2f} s "
        f"({100 * bg.get('s', 0.0) / step:.1f}% of step time, off the path); forecast stale rows measured there "
        f"{bg.get('pre_rows', 0)} ({bg.get('pre_groups', 0)} groups) in {bg.get('pre_s', 0.0):.2f} s "
        f"({100 * bg.get('pre_s', 0.0) / step:.1f}%); the steps' training throughput, median "
        f"{tok_s[len(tok_s) // 2] if tok_s else 0.0:.2f} tokens/s"
    )
    print(
        "by staleness [rows, flagged, failed]:", dict(sorted(by_staleness.items(), key=lambda kv: int(kv[0])))
    )
    print(
        f"largest distance under the step's forward {max(m['draws']['max_step'] for m in checked):.3g}, "
        f"of a flagged row kept {max(m['draws']['max_exact_kept'] for m in checked):.3g}; "
        f"rejected by reason {dict(rejected)}; drops at the end {metrics[-1].get('drops', {})}"
    )
    for label, part in (
        ("with a full batch at once", [m for m in checked if m.get("ingest_wait_s", 0.0) < AT_ONCE_S]),
        ("that waited for groups", [m for m in checked if m.get("ingest_wait_s", 0.0) >= AT_ONCE_S]),
    ):
        if not part:
            continue
        part_s = sum(m["step_s"] for m in part)
        ex = sum(m["draws"]["exact_s"] for m in part)
        fw = sum(m["draws"].get("forward_s", 0.0) for m in part)
        sk = sum((m.get("skip_audit") or {}).get("s", 0.0) for m in part)
        print(
            f"steps {label}: {len(part)}, on the path exact re-checks {100 * ex / part_s:.1f}% + distances "
            f"{100 * fw / part_s:.1f}% + skip records {100 * sk / part_s:.1f}% = "
            f"{100 * (ex + fw + sk) / part_s:.1f}% of their {part_s:.2f} s"
        )
    third = max(1, -(-len(checked) // 3))
    for i in range(0, len(checked), third):
        part = checked[i : i + third]
        audits = [m.get("skip_audit") or {} for m in part]
        part_s = sum(m["step_s"] for m in part)
        audit_s = sum(a.get("s", 0.0) for a in audits)
        idle_s = sum(a.get("idle_s", 0.0) for a in audits)
        print(
            f"skip records' audit, v{part[0]['version']}-v{part[-1]['version']}: "
            f"{sum(a.get('groups', 0) for a in audits) / len(part):.1f} records and "
            f"{sum(a.get('rows', 0) for a in audits) / len(part):.1f} rows per step, "
            f"{audit_s:.2f} s of {part_s:.2f} s on the path ({100 * audit_s / part_s:.1f}%), "
            f"{idle_s:.2f} s while waiting ({100 * idle_s / part_s:.1f}%)"
        )


if __name__ == "__main__":
    main()
