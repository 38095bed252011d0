"""The attack suite's report (`bench_attacks.py`): detection per arm, whether training still improved, the
temperature liar's detection curves, and the table BENCHMARKS.md records. Reads the arms' result dicts only
(no arena, no torch)."""

from __future__ import annotations

from typing import Any

NOT_ATTACKS = {"eager": "not an attack: honest content under the flood limit, held to a fair share"}
"""Arms that show a limit, not a detection: their groups are not expected to be rejected."""


def detection(res: dict[str, Any]) -> tuple[int, float | None, str]:
    """(hostile items, detection rate, how it was measured) of one arm."""
    from pnyx_harness.arena import BENIGN, TRAINED

    log = res["log"]
    if res["arm"] == "weight_forger":
        n = len(log.get("forged", []))
        refused = n - sum(log.get("served_forged", []))
        ok = res["served_only_trainer"] and res["version"] == res["steps"]
        return n, (refused / n if n and ok else 0.0), "forged versions refused by the follower"
    if res["arm"] == "fork_squatter":
        n = sum(2 for _ in log.get("squatted", []))
        ok = res["served_only_trainer"] and res["version"] == res["steps"]
        return n, (1.0 if ok else 0.0) if n else None, "squatted versions published through by the trainer"
    groups = res["hostile_groups"]
    if not groups:
        return 0, None, ""
    if res["arm"] in NOT_ATTACKS:
        return len(groups), None, NOT_ATTACKS[res["arm"]]
    rejected = sum(1 for g in groups if g["verdict"] not in (*BENIGN, TRAINED, "waiting"))
    return len(groups), rejected / len(groups), "hostile groups rejected"


def improves(res: dict[str, Any]) -> bool:
    return res["after"]["ci"][0] > res["before"]["ci"][1]


def curves(res: dict[str, Any]) -> dict[str, Any]:
    """The temperature liar's detection by completion length and by groups seen from its key."""
    from pnyx_harness.arena import BENIGN, TRAINED

    groups = [g for g in res["hostile_groups"] if g["verdict"] not in ("waiting",)]

    def rate(sel: list[dict[str, Any]]) -> float | None:
        judged = [g for g in sel if g["verdict"] not in BENIGN]
        return sum(g["verdict"] != TRAINED for g in judged) / len(judged) if judged else None

    by_len: dict[str, Any] = {}
    for lo, hi in ((0, 32), (32, 40), (40, 48), (48, 64), (64, 10**6)):
        sel = [g for g in groups if lo <= g["tokens"] < hi]
        by_len[f"{lo}-{hi if hi < 10**6 else ''}"] = {"groups": len(sel), "rate": rate(sel)}
    by_seen: dict[str, Any] = {}
    for lo, hi in ((1, 2), (2, 4), (4, 8), (8, 16), (16, 32), (32, 10**6)):
        sel = [g for g in groups if lo <= g["index"] < hi]
        by_seen[f"{lo}-{hi - 1 if hi < 10**6 else ''}"] = {"groups": len(sel), "rate": rate(sel)}
    top = max((g["index"] for g in groups), default=0)
    passes = next(
        (n for n in range(1, top + 1) if all((rate([g for g in groups if g["index"] >= m]) or 0) >= 0.99
                                              for m in range(n, top + 1))),
        None,
    )  # fmt: skip
    return {"by_length": by_len, "by_groups_seen": by_seen, "passes_99_from_group": passes}


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        "| attack | hostile | detection | how | trained on | batch share | verdicts | pass@1 v0 → end (Wilson 95%) "
        "| improves |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        n, rate, how = detection(res)
        trained = res["hostile"].get("trained", 0)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(res["hostile"].items()) if k != "trained") or "-"
        b, a = res["before"], res["after"]
        inb = res["log"].get("hostile_in_batch", [])
        total = sum(res["log"].get("batch_groups", [])) or 1
        share = f"{100 * sum(inb) / total:.0f}%" if inb and res["hostile_groups"] else "-"
        rows.append(
            f"| {res['arm']} | {n} | {'-' if rate is None else f'{100 * rate:.1f}%'} | {how or '-'} | "
            f"{trained if res['hostile_groups'] else '-'} | {share} | {reasons} | "
            f"{b['pass_at_1']:.3f} → {a['pass_at_1']:.3f} [{a['ci'][0]:.3f}, {a['ci'][1]:.3f}] (v{a['version']}) | "
            f"{'yes' if improves(res) else 'no'} |"
        )
    honest = sum(r["honest_uploaded"] for r in results)
    fp = sum(r["honest_fp"] for r in results)
    rows.append("")
    rows.append(f"False positives: {fp} of {honest} honest groups rejected for a non-benign reason "
                f"({100 * fp / max(1, honest):.2f}%).")  # fmt: skip
    return "\n".join(rows)


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Print the table and the per-attack figures of `results`; returns the summary saved beside them."""
    print(table(results))
    summary: dict[str, Any] = {
        "arms": {r["arm"]: {"detection": detection(r), "improves": improves(r)} for r in results}
    }
    liar = next((r for r in results if r["arm"] == "temperature_liar"), None)
    if liar is not None:
        summary["temperature_liar"] = c = curves(liar)
        print("\ntemperature liar, detection by completion length (model tokens per group):")
        print("  " + ", ".join(f"{k}: {v['rate']} ({v['groups']})" for k, v in c["by_length"].items()))
        print("temperature liar, detection by groups seen from its key:")
        print("  " + ", ".join(f"{k}: {v['rate']} ({v['groups']})" for k, v in c["by_groups_seen"].items()))
        print(f"  at or above 99% from group: {c['passes_99_from_group']}")
    for r in results:
        if r["arm"].startswith("poisoner") or r["arm"] == "none":
            a = r["after"]
            print(f"payload in held-out samples, {r['arm']}: v0 {r['before']['payload']}/{r['before']['tasks']}, "
                  f"v{a['version']} {a['payload']}/{a['tasks']} ({100 * a['payload_rate']:.1f}%)")  # fmt: skip
        if (r["arm"].startswith("cherry") or r["arm"] == "none") and "mean_tokens" in r["after"]:
            b, a = r["before"], r["after"]
            print(f"held-out answer length, {r['arm']}: v0 {b['mean_tokens']:.2f} tokens, "
                  f"v{a['version']} {a['mean_tokens']:.2f} (pass@1 {a['pass_at_1']:.3f})")  # fmt: skip
    return summary
