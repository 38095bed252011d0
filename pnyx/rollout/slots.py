"""What both decode sessions (`decoder.FastSession`, `hf_session.HFSession`) share about cache slots: the
position ids of an appended chunk, padding with holes, and the rows parked aside (`Parked`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def chunk_positions(pos: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Position ids [B, R] of a chunk appended after last positions `pos` [B, 1]: real tokens count up,
    holes repeat the previous position (they are masked, so their value only has to be valid)."""
    return pos + attn.long().cumsum(-1)


@dataclass
class Parked:
    """Rows taken out of a session (`take`) to be put back later (`merge`): their cache up to its length."""

    kv: list[tuple[torch.Tensor, torch.Tensor] | None]
    """Per layer: keys and values [r, kv heads, length, head dim], or None for a layer without a cache."""
    attn: torch.Tensor
    """[r, length] bool: which slots are real tokens."""
    pos: torch.Tensor
    """[r, 1]: the position id of each row's last real token."""

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer `i`, which the caller knows has a cache."""
        kv = self.kv[i]
        if kv is None:
            raise RuntimeError(f"parked rows have no cache for layer {i}")
        return kv


def pad_slots(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """`x` zero-padded (False for bool) along `dim` to `length`: holes must hold finite values, since a
    masked score is still computed from them."""
    extra = length - x.shape[dim]
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, torch.zeros(shape, dtype=x.dtype, device=x.device)], dim=dim)


def check_chunk(attn: torch.Tensor) -> None:
    """An appended chunk must end with a real token in every row."""
    if not bool(attn[:, -1].all()):
        raise ValueError("extend: every row's chunk must end with a real token (left-pad the chunk)")
