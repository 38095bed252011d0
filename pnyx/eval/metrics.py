"""Pure evaluation metrics: pass@k (unbiased estimator), cover-EM, search rate, mean of score parts.

Knows nothing about models, environments' internals or the store: inputs are counts, strings and
`Score`-like objects. Invariant: `pass_at_k(n, c, k)` equals 1 - C(n-c, k) / C(n, k) exactly (the
probability that k of the n samples, drawn without replacement, include a correct one), computed as a
stable product so it never overflows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from pnyx.envs.parsing import cover_em, normalize_answer

__all__ = [
    "cover_em",
    "mean_parts",
    "normalize_answer",
    "pass_at_k",
    "pass_at_k_groups",
    "search_rate",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from `n` samples of which `c` are correct (Chen et al. 2021).

    1 - C(n-c, k) / C(n, k), as the product form 1 - prod_{i=n-c+1}^{n} (1 - k/i).
    """
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k takes integers, got n={n!r} c={c!r} k={k!r}")
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n, 1 <= k <= n; got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def pass_at_k_groups(correct: Iterable[Sequence[bool | float]], k: int) -> float:
    """Mean pass@k over problems, each given as its samples' correctness (a reward >= 1 counts as correct)."""
    values = [pass_at_k(len(g), sum(1 for x in g if float(x) >= 1.0), k) for g in correct]
    if not values:
        raise ValueError("pass_at_k_groups needs at least one problem")
    return sum(values) / len(values)


def search_rate(num_searches: Iterable[float]) -> float:
    """Fraction of episodes that searched at least once (from each episode's number of searches)."""
    values = [float(x) for x in num_searches]
    return sum(1.0 for x in values if x > 0) / len(values) if values else 0.0


class _HasParts(Protocol):
    reward: float
    parts: Mapping[str, float]


def mean_parts(scores: Iterable[_HasParts]) -> dict[str, Any]:
    """Mean reward and mean of every part across scores: {"reward": ..., "correct": ..., "n": count}."""
    total: dict[str, float] = {}
    n = 0
    for s in scores:
        n += 1
        total["reward"] = total.get("reward", 0.0) + float(s.reward)
        for name, value in s.parts.items():
            total[name] = total.get(name, 0.0) + float(value)
    out: dict[str, Any] = {name: value / n for name, value in total.items()} if n else {}
    out["n"] = n
    return out
