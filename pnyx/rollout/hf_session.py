"""Decoding through the transformers forward and a `DynamicCache`: the generic session for any causal LM.

`HFSession` has the surface of `decoder.FastSession` (prefill, step with holes, extend, keep, take, merge)
and keeps the same invariant: row i's logits depend only on row i's real tokens, position ids count real
tokens only. It selects cache rows itself, because transformers' own `batch_select_indices` fails on
conv/recurrent layers (LFM2) and on hybrid layers would select keys/values but not the conv state. It
says what the model's cache allows (`can_keep`, `holes_ok` with `holes_reason`): holes are exact only in
plain full-attention layers, since a sliding window counts cache slots and a conv state takes in every
slot. Knows nothing about sampling, stop strings or tools.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from pnyx.rollout.slots import Parked, check_chunk, chunk_positions, pad_slots

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class _Absent:
    """A cache layer kind this transformers release lacks: no layer is one."""


def _cache_layer_kinds() -> tuple[type, type, type]:
    """(DynamicLayer, LinearAttentionCacheLayerMixin, DummyLayer). The last two came in later transformers 5
    releases than DynamicLayer (5.17, seen on a GPU machine, has neither): where one is absent no cache
    layer can be of that kind."""
    from transformers import cache_utils

    return (
        cache_utils.DynamicLayer,
        getattr(cache_utils, "LinearAttentionCacheLayerMixin", _Absent),
        getattr(cache_utils, "DummyLayer", _Absent),
    )


def _select_rows(cache: Any, rows: torch.Tensor) -> None:
    """Keep `rows` of every layer of a `DynamicCache`, conv and recurrent states included."""
    dynamic, linear, _ = _cache_layer_kinds()
    for layer in cache.layers:
        if isinstance(layer, linear):
            for states in (layer.conv_states, layer.recurrent_states):
                for k, st in states.items():
                    if st is not None:
                        states[k] = st.index_select(0, rows)
            if isinstance(layer, dynamic):  # hybrid layers: their own method only selects keys/values
                dynamic.batch_select_indices(layer, rows)
        else:
            layer.batch_select_indices(rows)


class HFSession:
    """Decode session through the transformers forward and a `DynamicCache` (any causal LM)."""

    def __init__(self, model: PreTrainedModel, max_len: int):
        self.model = model
        self.max_len = max_len
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed the argument `past_key_values` -> `cache`.
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.extra: dict[str, Any] = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._new_cache()

    def _new_cache(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache(config=self.model.config)
        self._inspect_cache()

    def _call(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # The cache is updated in place.
        out = self.model(
            input_ids=ids,
            attention_mask=self.attn.long(),
            position_ids=pos,
            use_cache=True,
            **self.extra,
            **{self.cache_arg: self.cache},
        )
        return out.logits[:, -1]

    def _inspect_cache(self) -> None:
        """What this model's cache allows: dropping rows (known layer kinds) and holes (attention only)."""
        dynamic, linear, dummy = _cache_layer_kinds()
        layers = list(self.cache.layers)
        if not layers:  # built lazily by the first forward: kinds unknown until then
            self.can_keep, self.holes_ok, self.holes_reason = (
                False,
                False,
                "cache layers not known before a forward",
            )
            return
        self.can_keep = all(isinstance(la, (dynamic, linear, dummy)) for la in layers)
        self.holes_ok, self.holes_reason = True, None
        for la in layers:
            if isinstance(la, linear):
                self.holes_ok = False
                self.holes_reason = (
                    f"{type(la).__name__}: a conv/recurrent state takes in every slot, holes too"
                )
            elif not isinstance(la, dummy) and type(la) is not dynamic:
                self.holes_ok = False
                self.holes_reason = (
                    f"{type(la).__name__}: sliding-window or chunked attention counts cache slots, not tokens"
                )
            if not self.holes_ok:
                break

    def prefill(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        if self.cache.get_seq_length() > 0:
            self._new_cache()
        self.attn = attn
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
        self.pos = pos[:, -1:]
        logits = self._call(ids, pos)
        self._inspect_cache()
        return logits

    def step(self, tokens: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        if live is None:
            live = torch.ones(self.attn.shape[0], dtype=torch.bool, device=self.attn.device)
        self.pos = self.pos + live[:, None].long()
        self.attn = torch.cat([self.attn, live[:, None]], dim=1)
        return self._call(tokens[:, None], self.pos)

    def extend(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        check_chunk(attn)
        pos = chunk_positions(self.pos, attn)
        self.attn = torch.cat([self.attn, attn], dim=1)
        self.pos = pos[:, -1:]
        return self._call(ids, pos)

    def keep(self, rows: torch.Tensor) -> None:
        if not self.can_keep:
            raise ValueError("this model's cache has layers pnyx cannot select rows of; check can_keep first")
        _select_rows(self.cache, rows)
        self.attn = self.attn[rows]
        self.pos = self.pos[rows]

    def _kv_layers(self) -> list:
        if not self.holes_ok:
            raise ValueError(f"rows of this model's cache cannot be parked: {self.holes_reason}")
        return [
            la if (keys := getattr(la, "keys", None)) is not None and keys.numel() else None
            for la in self.cache.layers
        ]

    def take(self, rows: torch.Tensor) -> Parked:
        """A copy of `rows`' state (the session is unchanged). Only where `holes_ok` (attention-only cache)."""
        kv = [None if la is None else (la.keys[rows], la.values[rows]) for la in self._kv_layers()]
        return Parked(kv, self.attn[rows], self.pos[rows])

    def merge(self, parked: list[Parked]) -> None:
        """Append parked rows after the current ones; their slots since they were taken become holes."""
        if not parked:
            return
        used = self.attn.shape[1]
        for li, la in enumerate(self._kv_layers()):
            if la is not None:
                la.keys = torch.cat([la.keys] + [pad_slots(p.layer(li)[0], used, 2) for p in parked])
                la.values = torch.cat([la.values] + [pad_slots(p.layer(li)[1], used, 2) for p in parked])
        self.attn = torch.cat([self.attn] + [pad_slots(p.attn, used, 1) for p in parked])
        self.pos = torch.cat([self.pos] + [p.pos for p in parked])
