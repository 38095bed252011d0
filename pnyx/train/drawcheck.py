"""The per-token check of seeded draws: every model token a worker sends must be the draw of its uniform.

A seeded group (`RolloutGroup.draws == pnyx.protocol.draws.SCHEME`) drew token t of sample i by inverse
CDF from uniform u_{i,t}, derived from the run, the signing key, the worker id, the task, the version, the
seq and i (`pnyx.protocol.draws`): the token is the one whose interval [F(y-1), F(y)) of the vocabulary-
order CDF of the sampling distribution (temperature, top-k, top-p: `sampling_logprobs`) holds u. The check
recomputes that distribution at every model token, teacher-forced, under exactly the published weights of
the group's version (`published.PublishedModel`: the weights the worker proved it sampled from, so
staleness adds nothing) and measures each token's **distance**: 0 when u lies in its interval, else how far
outside. A group passes only if every distance is at most `tolerance`, which absorbs the engines'
rounding (a worker's fp16-copy matmuls or MLX kernels against this fp32 forward move interval edges by
~1e-6). With tolerance 0 a passing group is the honest draw token for token (by induction over
positions): a temperature liar, a cherry-picker of samples, or a worker that re-rolls a sample has no
choice left but to send the honest draw. Measured design: docs/verifiable-sampling.md.

Cost: one no-grad forward per group, the prompt once (its KV cache repeated over the samples), then the
completions on top of it; on a version change, copying the changed tensors (`PublishedModel`). Runs in the
ingestion threads, beside the step. Knows nothing about the ledger or the loop.
"""

from __future__ import annotations

import copy
import functools
import inspect
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from pnyx.errors import ConfigError, IntegrityError, PnyxError
from pnyx.models.logprobs import sampling_logprobs
from pnyx.protocol.draws import SCHEME, sample_seed, uniforms
from pnyx.protocol.records import RolloutGroup
from pnyx.train.published import PublishedModel

log = logging.getLogger("pnyx.trainer")

TOLERANCE = 1e-3
"""Default largest distance of an honest token (`security.draw_tolerance`); see docs/security.md."""
MAX_LOGITS = 32 * 1024 * 1024
"""Rows x positions x vocabulary of one forward's logits (float32: 128 MB); larger groups run in chunks."""
THREADS = 1
"""The check's forward runs on one thread: it runs beside the step, whose own threads already fill the
cores (two forwards with torch's full count each oversubscribe them)."""
CALL_TOKENS = 256
"""The prompt's KV cache is shared over the rows only if that saves more than this many token positions (a
second forward call and copying the cache cost about that much on a small model)."""

MISMATCH = "draw_mismatch"
"""Reason of a group with a token its uniform did not draw (a fault of its key)."""
UNSEEDED = "unseeded"
"""Reason of a group without seeded draws in a run that requires them (a fault of its key)."""
UNVERIFIABLE = "unverifiable"
"""Reason of a group whose version's published weights could not be obtained or verified (not a fault)."""


@dataclass
class DrawStats:
    """What the check has done so far (the trainer reports it)."""

    groups: int = 0
    tokens: int = 0
    seconds: float = 0.0
    failed: int = 0
    max_passing: float = 0.0
    """The largest distance of a token in a passing group: how close honest tokens come to the tolerance."""
    by_reason: dict[str, int] = field(default_factory=dict)
    by_staleness: dict[str, list[int]] = field(default_factory=dict)
    """Staleness at the check (the newest published version minus the group's) -> [seeded groups checked,
    failed]."""


def distances(model: torch.nn.Module, group: RolloutGroup, key: str, pad_id: int = 0) -> list[np.ndarray]:
    """Per sample, the distance of each model token's uniform from its CDF interval under `model`."""
    samples = list(group.samples)
    out: list[np.ndarray] = []
    with torch.no_grad():
        for a, full in _completion_logits(
            model, list(group.prompt_tokens), [s.tokens for s in samples], pad_id
        ):
            for i, s in enumerate(samples[a : a + full.shape[0]]):
                at = [j for j, m in enumerate(s.loss_mask) if m]
                if not at:
                    out.append(np.zeros(0))
                    continue
                seed = sample_seed(
                    group.run_id, key, group.worker_id, group.task_id, group.policy_version, group.seq, a + i
                )
                logp = sampling_logprobs(full[i, at], group.temperature, group.top_k, group.top_p)
                out.append(_interval_distance(logp, [s.tokens[j] for j in at], uniforms(seed, len(at))))
    return out


def _completion_logits(
    model: torch.nn.Module, prompt: list[int], completions: list[list[int]], pad_id: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """(first row, logits [rows, width, V]) per chunk of `completions`: position j predicts token j.

    The prompt is computed once and its KV cache repeated over the rows where that saves work (a long
    prompt, several rows); else each row is prompt + completion in one plain forward (fewer calls: what
    small models are bound by)."""
    dev = next(model.parameters()).device
    n, width, plen = len(completions), max(len(c) for c in completions), len(prompt)
    shared = plen + n * width + CALL_TOKENS < n * (plen + width)
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 1 << 17)
    rows = max(1, MAX_LOGITS // max(1, (width + (0 if shared else plen)) * vocab))
    cache = last = None
    accepted = _forward_parameters(type(model))
    cache_arg = "cache" if "cache" in accepted else "past_key_values"
    if shared:
        keep = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}
        first = model(
            torch.tensor([prompt], device=dev), use_cache=True, **keep
        )  # the prompt's last logits only
        cache = getattr(first, "cache", None) or getattr(first, "past_key_values", None)
        if cache is None:
            raise ConfigError(f"{type(model).__name__} returned no KV cache: its draws cannot be checked")
        last = first.logits[:, -1:].float()
    for a in range(0, n, rows):
        chunk = completions[a : a + rows]
        k = len(chunk)
        head = 0 if shared else plen
        ids = torch.full((k, head + width), pad_id, dtype=torch.long)
        attn = torch.zeros((k, plen + width), dtype=torch.long)
        attn[:, :plen] = 1
        if not shared:
            ids[:, :plen] = torch.tensor(prompt, dtype=torch.long)
        for i, c in enumerate(chunk):  # right-padded: real tokens keep their positions
            ids[i, head : head + len(c)] = torch.tensor(c, dtype=torch.long)
            attn[i, plen : plen + len(c)] = 1
        if shared:
            kv = copy.deepcopy(cache)
            kv.batch_repeat_interleave(k)  # pyright: ignore[reportOptionalMemberAccess]  (set when shared)
            logits = model(ids.to(dev), attention_mask=attn.to(dev), use_cache=True, **{cache_arg: kv}).logits
            yield a, torch.cat([last.expand(k, 1, -1), logits[:, :-1].float()], dim=1)  # pyright: ignore[reportOptionalMemberAccess]
        else:
            logits = model(ids.to(dev), attention_mask=attn.to(dev)).logits
            yield a, logits[:, plen - 1 : plen - 1 + width].float()


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    """The keyword names a model class's `forward` takes (read once per class, not per group)."""
    return frozenset(inspect.signature(model_class.forward).parameters)


def _interval_distance(logp: torch.Tensor, tokens: list[int], u: np.ndarray) -> np.ndarray:
    """Distance of each u from its token's interval [F(y-1), F(y)) / F(V-1) of the vocabulary-order CDF."""
    p = logp.exp().double()
    cdf = p.cumsum(-1)
    total = cdf[:, -1]
    y = torch.tensor(tokens, dtype=torch.long)[:, None]
    hi = cdf.gather(-1, y)[:, 0] / total
    lo = hi - p.gather(-1, y)[:, 0] / total
    uu = torch.from_numpy(u.astype(np.float64))
    return torch.clamp(torch.maximum(lo - uu, uu - hi), min=0.0).numpy()


class DrawCheck:
    """`check(group, key)` -> None (every token is its draw) or a drop reason (see the module docstring).

    `published`: the run's published-weights models by plane ("weights", and "int8" when the run publishes
    the actor plane); a group is checked on the plane whose chain digest it records."""

    def __init__(self, published: dict[str, PublishedModel], tolerance: float = TOLERANCE, pad_id: int = 0):
        self.published = published
        self.tolerance = tolerance
        self.pad_id = pad_id
        self.stats = DrawStats()
        self._lock = threading.Lock()  # checks run in several ingestion threads
        self._closed = False
        self.threads: int | None = THREADS
        """Intra-op threads of the check's forward, in the ingestion thread that runs it (None: torch's)."""

    def close(self, timeout_s: float = 60.0) -> None:
        """Refuse new checks and wait (at most `timeout_s` per model) for the one in flight: a forward that is
        still running in a daemon thread when the interpreter exits aborts the process."""
        self._closed = True
        for pm in self.published.values():
            if pm.lock.acquire(timeout=timeout_s):
                pm.lock.release()

    def check(self, group: RolloutGroup, key: str, staleness: int | None = None) -> str | None:
        """None if every model token of `group` (signed by `key`) is the draw of its uniform, else the drop
        reason. `staleness` (the trainer's newest version minus the group's) is only counted."""
        if group.draws != SCHEME or not key:
            return self._count(UNSEEDED, 0, 0.0, None)
        if self._closed:
            return UNVERIFIABLE  # the trainer is stopping: the group is not filed anyway
        before = torch.get_num_threads()
        if (
            self.threads is not None
        ):  # the calling thread's count (OpenMP keeps one per thread): not the step's
            torch.set_num_threads(self.threads)
        t0 = time.perf_counter()
        try:
            d = self._distances(group, key)
        except PnyxError as e:  # fail-closed: never passed unchecked; not blamed on the key either
            log.warning("trainer: cannot check the draws of a v%d group (%s)", group.policy_version, e)
            return self._count(UNVERIFIABLE, 0, time.perf_counter() - t0, None)
        finally:
            torch.set_num_threads(before)
        worst = max((float(x.max()) for x in d if x.size), default=0.0)
        tokens = sum(x.size for x in d)
        reason = MISMATCH if worst > self.tolerance else None
        return self._count(reason, tokens, time.perf_counter() - t0, worst, staleness)

    def _distances(self, group: RolloutGroup, key: str) -> list[np.ndarray]:
        for plane, pm in self.published.items():
            with pm.lock:
                if self._closed:
                    raise IntegrityError("the trainer is stopping")
                model = pm.at(group.policy_version)
                if pm.digest == group.weights_digest or len(self.published) == 1:
                    return distances(model, group, key, self.pad_id)
            log.debug("v%d group not on the %s plane", group.policy_version, plane)
        raise IntegrityError(
            f"no published plane of v{group.policy_version} has digest {group.weights_digest}"
        )

    def _count(
        self,
        reason: str | None,
        tokens: int,
        seconds: float,
        worst: float | None,
        staleness: int | None = None,
    ) -> str | None:
        with self._lock:
            self._add(reason, tokens, seconds, worst, staleness)
        return reason

    def _add(
        self, reason: str | None, tokens: int, seconds: float, worst: float | None, staleness: int | None
    ) -> None:
        s = self.stats
        if staleness is not None and worst is not None:
            row = s.by_staleness.setdefault(str(staleness), [0, 0])
            row[0] += 1
            row[1] += reason is not None
        s.groups += 1
        s.tokens += tokens
        s.seconds += seconds
        if reason is None:
            if worst is not None:
                s.max_passing = max(s.max_passing, worst)
        else:
            s.failed += 1
            s.by_reason[reason] = s.by_reason.get(reason, 0) + 1
