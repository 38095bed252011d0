"""The frozen reference policy of the KL term, kept off the training step's critical path.

With `algorithm.kl_coef > 0` the loss needs log π_ref of every completion token. The reference never
changes, so its logprobs are a property of a group: they are computed once per group, by a background
thread, as soon as the trainer sees the group (while it waits for a full batch), and cached. The step
then only looks them up; a group the thread has not reached yet is scored on the spot. Only rank 0 holds
the reference model (in the compute dtype, on `trainer.reference_device`); the logprobs travel to the other
ranks with the batch.

Knows nothing about the store or the optimizer. Invariant: `logprobs` returns, for every non-empty
sample, exactly the values `completion_logprobs` gives under the group's own sampling settings, whether
they were prefetched or not.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from pnyx.train.ingest import ScoredGroup

log = logging.getLogger("pnyx.train")

CACHE_GROUPS = 4096
"""Groups whose reference logprobs are kept (oldest forgotten first; a forgotten one is recomputed)."""


class Reference:
    """The reference model and its per-group logprob cache, filled by a prefetch thread."""

    def __init__(
        self,
        model_dir: Path,
        device: str | torch.device,
        dtype: torch.dtype,
        round_to: torch.dtype | None = None,
    ):
        """`round_to`: the dtype the trainer's steps round their weights to (`train_step(forward_dtype=)`):
        the reference is then v0 as published, the weights the policy's forward starts from."""
        from pnyx.models import load_model

        self.model = load_model(model_dir, dtype=str(dtype).removeprefix("torch."), device=device)
        if round_to is not None:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(p.to(round_to))
        self.model.requires_grad_(False)
        self.model.eval()
        self._cache: OrderedDict[str, list[list[float]]] = OrderedDict()
        self._lock = threading.Lock()  # one forward at a time on the model; guards the cache
        self._queue: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pnyx-reference", daemon=True)
        self._thread.start()

    def prefetch(self, groups: Iterable[Any]) -> None:
        """Queue groups (ScoredGroup) for scoring in the background; never blocks."""
        for g in groups:
            if g.key not in self._cache:
                self._queue.put(g)

    def logprobs(self, groups: Iterable[Any]) -> dict[tuple[str, int], list[float]]:
        """(group key, sample index) -> reference logprobs of that completion, for every sample with tokens."""
        if self._error is not None:
            raise RuntimeError("the reference prefetch thread failed") from self._error
        out: dict[tuple[str, int], list[float]] = {}
        for g in groups:
            per_sample = self._score(g)
            for i, lp in enumerate(per_sample):
                if lp:
                    out[(g.key, i)] = lp
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _score(self, g: ScoredGroup) -> list[list[float]]:
        from pnyx.models.logprobs import completion_logprobs

        with self._lock:
            hit = self._cache.get(g.key)
            if hit is not None:
                return hit
            rec = g.group
            comps = [list(s.tokens) for s in rec.samples]
            live = [i for i, c in enumerate(comps) if c]
            out: list[list[float]] = [[] for _ in comps]
            if live:
                with torch.no_grad():
                    logp, _, _ = completion_logprobs(
                        self.model,
                        [list(rec.prompt_tokens)] * len(live),
                        [comps[i] for i in live],
                        temperature=float(rec.temperature),
                        top_k=int(rec.top_k),
                        top_p=float(rec.top_p),
                    )
                for j, i in enumerate(live):
                    out[i] = logp[j, : len(comps[i])].float().tolist()
            self._cache[g.key] = out
            while len(self._cache) > CACHE_GROUPS:
                self._cache.popitem(last=False)
            return out

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                g = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            try:
                self._score(g)
            except BaseException as e:  # surfaced by the next logprobs() call in the loop
                self._error = e
                log.error("trainer reference prefetch failed: %s", e)
                return
