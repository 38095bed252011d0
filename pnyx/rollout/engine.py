"""The generation engine: batched sampling with a KV cache, per-token behaviour logprobs, stop strings.

`Engine.generate` samples completions for a batch of token-id prompts of any lengths (left-padded, masked,
position ids counting real tokens only). For every sampled token it records the log-probability under the
exact distribution it was drawn from (`pnyx.models.logprobs.sampling_logprobs`: temperature, top-k, top-p),
so `completion_logprobs` on the trainer reproduces it. Greedy (temperature 0) records the temperature-1,
untruncated logprob of the argmax token. Completions end at EOS (the EOS token is kept, it is the model's
choice to stop), at a stop string (the token that completes it is kept; detected on a decoded window of the
last few tokens, never by re-tokenizing), or at `max_new_tokens`. Finished rows leave the batch.

Seeded: the same model, prompts and `SamplingParams` (seed included) give the same tokens. A row's draw
depends on the whole batch, so the same prompt in a different batch may sample differently, unless the rows
carry seeded draws (`SamplingParams.draws`, `pnyx.protocol.draws`): then row i's t-th token takes the t-th
uniform of its own stream, and its tokens depend only on the weights, its context and that stream.
`Engine.decode` is the sampling loop over an open decode session (`decoder.py`); `generate` prefills a
fresh one, and the multi-turn tool loop (`episodes.run_episodes`) keeps one across turns.

This is the torch decode loop, not an engine of the engine protocol: everything that samples goes through
`pnyx.rollout.engines` (`WorkerEngine`), whose torch engine (`engines/torch.py`) wraps this class.
Runs on the model's device and dtype (CPU or CUDA) with one host sync per step, none when no row can end
early. Knows nothing about environments' scoring, the store or the trainer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

from pnyx.errors import ConfigError
from pnyx.models.logprobs import sampling_logprobs
from pnyx.models.tokenizer import StopMatcher, eos_token_ids
from pnyx.rollout.decoder import FastSession, Parked, left_pad, open_session
from pnyx.rollout.sampling import (
    COMPACT_FRACTION,
    Completion,
    FinishReason,
    SamplingParams,
    Turn,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from pnyx.protocol.draws import UniformStream
    from pnyx.rollout.hf_session import HFSession


class Engine:
    """Batched sampling from a causal LM (any transformers model; a fast path for Llama-shaped ones): the
    decode loop of the torch engine (`pnyx.rollout.engines.torch.TorchEngine`)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        fast: bool | None = None,
        half_weights: bool | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.fast = fast
        self.half_weights = half_weights
        self.eos_ids = eos_token_ids(tokenizer, model)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = pad if isinstance(pad, int) else 0
        self.device = next(model.parameters()).device

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt, in order."""
        if not prompt_ids:
            return []
        if any(len(p) == 0 for p in prompt_ids):
            raise ConfigError("every prompt needs at least one token")
        with torch.inference_mode():
            ids, attn = left_pad(prompt_ids, self.pad_id, self.device)
            session = self.session(ids.shape[1] + params.max_new_tokens)
            turn = self.decode(session, session.prefill(ids, attn), params)
        return [
            Completion(t, lp, r, cast(str, self.tokenizer.decode(t, skip_special_tokens=True)), s)
            for t, lp, r, s in zip(turn.tokens, turn.logprobs, turn.reasons, turn.stops, strict=True)
        ]

    def session(self, max_len: int) -> FastSession | HFSession:
        """A fresh decode session for this engine's model (`max_len`: the slots to preallocate)."""
        return open_session(self.model, max_len, self.fast, self.half_weights)

    def decode(
        self,
        session: FastSession | HFSession,
        logits: torch.Tensor,
        params: SamplingParams,
        park: frozenset[str] = frozenset(),
    ) -> Turn:
        """Sample from `session` (whose rows gave `logits` [n, V]) until every row ends.

        Rows that end leave the batch once >= 25% of it has ended, exactly as in a fresh `generate` of
        these rows, so seeded draws are the same. A row ended by a stop string in `park` is set aside
        (`take`) instead of dropped and put back (`merge`) after the turn, its missed slots as holes, so
        the caller can append to it; other ended rows are dropped. Call inside `torch.inference_mode()`.
        """
        n, max_new, dev = logits.shape[0], params.max_new_tokens, self.device
        params.check_rows(n)
        gen = torch.Generator(device=dev).manual_seed(params.seed)
        matcher = StopMatcher(self.tokenizer, params.stop)
        eos = frozenset() if params.ignore_eos else frozenset(self.eos_ids)
        if not eos and not matcher.stops:  # no row can end early: no host sync per token
            return self._decode_blind(session, logits, params, gen)
        tokens: list[list[int]] = [[] for _ in range(n)]
        reasons: list[FinishReason] = ["length"] * n
        stop_of: list[str | None] = [None] * n
        done = [False] * n
        out_lp = torch.zeros(n, max_new, dtype=torch.float32, device=dev)
        batch = list(range(n))  # the session's rows: exactly what a fresh `generate` of these rows holds
        batch_dev = torch.arange(n, device=dev)
        parked: list[tuple[list[int], Parked]] = []  # rows set aside on a park stop, to put back at the end
        live: torch.Tensor | None = None  # per session row: False = feed a hole (it has ended)
        draws = params.draws
        for step in range(max_new):
            tok, lp = self._draw(logits, params, gen, _uniforms(draws, batch, dev))
            out_lp[batch_dev, step] = lp
            changed = False
            for i, t in zip(batch, tok.tolist(), strict=True):  # the one host sync per step
                if done[i]:
                    continue  # ended but not yet compacted: its draw is consumed, its token ignored
                tokens[i].append(t)
                if draws is not None:
                    draws[i].advance()
                if t in eos:
                    done[i], reasons[i], changed = True, "stop", True
                elif matcher.stops and (s := matcher.match(tokens[i])) is not None:
                    done[i], reasons[i], stop_of[i], changed = True, "stop", s, True
            alive = sum(not done[i] for i in batch)
            if step == max_new - 1 or alive == 0:
                break
            if session.can_keep and len(batch) - alive >= max(1, COMPACT_FRACTION * len(batch)):
                wait = [k for k, i in enumerate(batch) if done[i] and stop_of[i] in park]
                if wait:
                    parked.append(([batch[k] for k in wait], session.take(torch.tensor(wait, device=dev))))
                keep = [k for k, i in enumerate(batch) if not done[i]]
                index = torch.tensor(keep, device=dev)
                session.keep(index)
                tok, batch = tok[index], [batch[k] for k in keep]
                batch_dev = torch.tensor(batch, device=dev)
                changed = True
            if changed:
                ended = [done[i] for i in batch]
                live = torch.tensor([not d for d in ended], device=dev) if any(ended) else None
            logits = session.step(tok, live)
        if parked:
            session.merge([p for _, p in parked])
            batch = batch + [i for rows, _ in parked for i in rows]
        lp_rows = out_lp.tolist()
        logprobs = [lp_rows[i][: len(tokens[i])] for i in range(n)]
        return Turn(tokens, logprobs, reasons, stop_of, batch)

    def _decode_blind(
        self,
        session: FastSession | HFSession,
        logits: torch.Tensor,
        params: SamplingParams,
        gen: torch.Generator,
    ) -> Turn:
        """`decode` when nothing can end a row before `max_new_tokens`: tokens stay on the device until the
        end, so the host never waits for the accelerator inside the loop."""
        n, max_new = logits.shape[0], params.max_new_tokens
        out_tok = torch.zeros(n, max_new, dtype=torch.long, device=self.device)
        out_lp = torch.zeros(n, max_new, dtype=torch.float32, device=self.device)
        rows = list(range(n))
        for step in range(max_new):
            tok, out_lp[:, step] = self._draw(logits, params, gen, _uniforms(params.draws, rows, self.device))
            out_tok[:, step] = tok
            for s in params.draws or ():
                s.advance()
            if step < max_new - 1:
                logits = session.step(tok)
        return Turn(out_tok.tolist(), out_lp.tolist(), ["length"] * n, [None] * n, list(range(n)))

    @staticmethod
    def _draw(
        logits: torch.Tensor, params: SamplingParams, gen: torch.Generator, u: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token [b], its logprob [b]) from last-position logits [b, V] under `params`; `u` [b]: the rows'
        seeded uniforms (`pnyx.protocol.draws`), else drawn from `gen`."""
        logp = sampling_logprobs(logits, params.temperature, params.top_k, params.top_p)
        if params.temperature <= 0:
            tok = logp.argmax(-1)
        else:
            # Inverse-CDF sampling: one uniform per row (cheaper than a Gumbel draw per vocabulary entry).
            # right=True returns the first index whose cumulative mass exceeds u, which always has p > 0.
            # cummax keeps the CDF flat across zero-probability (truncated) tokens even where a parallel
            # scan (CUDA) rounds differently at neighbouring entries, so such a token is never drawn.
            # On the CPU the drawn token is checked instead: the cummax pass (the costliest of sampling there)
            # runs only if a token with p = 0 was drawn, which a sequential scan never gives.
            p = logp.exp()
            if u is None:
                rand = torch.rand(p.shape[0], 1, generator=gen, device=p.device, dtype=p.dtype)
            else:
                rand = u[:, None].to(p.dtype)
            tok = None
            if p.device.type == "cpu":
                cdf = p.cumsum(-1)
                tok = torch.searchsorted(cdf, rand * cdf[:, -1:], right=True).squeeze(-1)
                tok = tok.clamp_(max=cdf.shape[-1] - 1)
                if not bool(p.gather(-1, tok[:, None]).all()):
                    tok = None
            if tok is None:
                cdf = torch.where(p > 0, p.cumsum(-1), 0.0).cummax(-1).values
                tok = torch.searchsorted(cdf, rand * cdf[:, -1:], right=True).squeeze(-1)
                tok = tok.clamp_(max=cdf.shape[-1] - 1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _uniforms(
    draws: list[UniformStream] | None, rows: list[int], device: torch.device
) -> torch.Tensor | None:
    """The next seeded uniform of each of `rows` (float32 [len(rows)]), or None without seeded draws."""
    if draws is None:
        return None
    return torch.tensor([draws[i].peek() for i in rows], dtype=torch.float32, device=device)
