"""Incremental decoding of a left-padded batch with a key/value cache: prefill, step, extend, drop rows.

Two interchangeable sessions share one surface:
- `prefill(ids, attn) -> logits`: a left-padded batch [B, P] with its mask; logits [B, V] of the last slot.
- `step(tokens, live=None) -> logits`: one token per row; a row whose `live` flag is False gets a *hole*
  (a masked slot that does not count as a position), so a row can wait while others decode.
- `extend(ids, attn) -> logits`: a left-padded chunk [B, R] appended on top of the cache (tool replies of
  different lengths; the pads become holes). The last column must be real for every row.
- `keep(rows)`: drop every other row of the batch (finished rows leave).
- `take(rows) -> Parked` and `merge(parked)`: set rows aside (a row waiting for its tool costs nothing
  while the others decode) and put them back after the current rows, the slots they missed as holes.

- `FastSession`: a direct forward of Llama-shaped decoders (Llama, Qwen2, Mistral without sliding window,
  Qwen3 with its per-head q/k RMSNorm) over the model's own parameters, with a growable preallocated cache,
  a precomputed rotary table, and q/k/v and gate/up each as one matmul (`fused_linear`). It skips the
  per-call mask building, output dataclasses and cache bookkeeping of the transformers forward.
  On CPU, an fp32 model whose weight matrices are float16-exact (within `HALF_WEIGHTS_ERROR`; the bf16
  values a worker holds after applying a published version are) multiplies from packed float16 copies of
  them with fp32 activations and accumulation (fbgemm's fp16 GEMM): half the bytes per step, fp32
  arithmetic. A matrix that is not float16-exact stays an fp32 matmul (`packed_half`). The copies are packed
  on a background thread after each change (~1.3 s of CPU for SmolLM2-135M), the matrices multiplying in
  fp32 meanwhile, so a worker's first batch after a new version never waits for them.
- `HFSession` (`hf_session.py`): the transformers forward with a `DynamicCache`, for every other causal LM.

Invariant of both: row i's logits depend only on row i's real tokens; position ids count real tokens only
(holes and padding never advance them); padded or hole query rows always see at least one key, so no NaN
appears. Holes are exact only where attention is the only way tokens meet: a sliding window or chunked
attention counts cache slots, not tokens, and a conv or recurrent state takes in every slot, so there
`HFSession.holes_ok` is False (with `holes_reason`) and callers must not leave holes in rows they keep
(the engine then re-prefills between tool turns). Rows that will be dropped may hold holes anywhere.
Parameters are never copied: the stacked q/k/v and gate/up tensors back the model's own parameters, so
weights loaded in place are used by the next session (a replaced parameter is restacked).
Knows nothing about sampling, stop strings or tools.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F

from pnyx.errors import ConfigError
from pnyx.rollout.hf_session import HFSession
from pnyx.rollout.slots import Parked, check_chunk, chunk_positions, pad_slots

if TYPE_CHECKING:
    from transformers import PreTrainedModel

FAST_MODEL_TYPES = ("qwen2", "llama", "mistral", "qwen3")
QK_NORM_MODEL_TYPES = ("qwen3",)
HALF_WEIGHTS_ERROR = 2.0**-25
"""Largest |w - float16(w)| of any weight of a matrix multiplied from its float16 copy. bf16 values up to
65504 meet it (exact in float16 down to 2^-17; below, float16's subnormal spacing 2^-24 rounds them by at most
2^-25); a generic fp32 weight (relative error 2^-11 in float16) does not."""


def fast_path_supported(model: PreTrainedModel) -> bool:
    """True if `FastSession` reproduces this model's forward exactly (architecture and options checked)."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in FAST_MODEL_TYPES:
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return False
    if getattr(cfg, "use_sliding_window", False) or (
        cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None)
    ):
        return False
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types and any(t != "full_attention" for t in layer_types):
        return False
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) in ("dynamic", "longrope"):
        return False  # their frequencies depend on the sequence length seen so far
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(body, "rotary_emb"):
        return False
    # adapter layers (peft's LoRA in a swarm node's policy): the fast path reads plain weights only
    if any(hasattr(m, "base_layer") for m in body.modules()):
        return False
    if cfg.model_type in QK_NORM_MODEL_TYPES:
        attn = body.layers[0].self_attn
        return hasattr(attn, "q_norm") and hasattr(attn, "k_norm")
    return True


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as the transformers RMSNorm: normalise in float32, cast back, then scale.
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _backs(fused: torch.Tensor | None, parts: list[torch.Tensor]) -> bool:
    """True if `parts` are consecutive row blocks of `fused` (so `fused` holds their current values)."""
    if fused is None:
        return False
    offset = fused.data_ptr()
    for p in parts:
        if p.data_ptr() != offset or not p.is_contiguous():
            return False
        offset += p.numel() * p.element_size()
    return offset == fused.data_ptr() + fused.numel() * fused.element_size()


@torch.inference_mode(False)
@torch.no_grad()
def fused_linear(owner: Any, name: str, linears: list[Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the linears stacked along outputs, as one tensor that backs their parameters.

    The first call concatenates the weights and re-points each linear's parameter at its row block of the
    stacked tensor, so later in-place updates (`load_state_dict`, an optimizer step) land in the stacked
    tensor too and no memory is duplicated. If a parameter was replaced since, it is rebuilt. Built outside
    inference mode (even when called inside it), so the parameters stay usable by autograd.
    """
    cached = getattr(owner, name, None)
    weights = [m.weight for m in linears]
    biases = [m.bias for m in linears]
    has_bias = all(b is not None for b in biases)
    if cached is not None and _backs(cached[0], weights) and (not has_bias or _backs(cached[1], biases)):
        return cached
    if not has_bias and any(bb is not None for bb in biases):
        raise ValueError(f"{name}: some but not all fused linears have a bias")
    w = torch.cat([p.data for p in weights])
    b = torch.cat([p.data for p in biases]) if has_bias else None
    row = 0
    for m in linears:
        n = m.weight.shape[0]
        m.weight.data = w[row : row + n]
        if b is not None:
            m.bias.data = b[row : row + n]
        row += n
    object.__setattr__(owner, name, (w, b))  # a plain attribute: not a parameter, not in the state dict
    return w, b


def half_weights_available(model: PreTrainedModel) -> bool:
    """True if `packed_half` can serve this model: fp32 on the CPU, with fbgemm's fp16 GEMM in this torch."""
    weight = next(model.parameters())
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and "fbgemm" in torch.backends.quantized.supported_engines
        and hasattr(torch.ops.quantized, "linear_prepack_fp16")
    )


def _half_copy(weight: torch.Tensor, bias: torch.Tensor | None) -> Any | None:
    """fbgemm's packed float16 copy of `weight` (+ fp32 `bias`), or None if `weight` is not float16-exact."""
    with torch.inference_mode(False), torch.no_grad():
        half = weight.to(torch.float16)
        back = half.float()
        exact = torch.equal(back, weight) or (
            bool(torch.isfinite(half).all()) and float((back - weight).abs().max()) <= HALF_WEIGHTS_ERROR
        )
        del half, back
        return torch.ops.quantized.linear_prepack_fp16(weight, bias) if exact else None


_packer: ThreadPoolExecutor | None = None
_copies: WeakKeyDictionary[Any, dict[str, tuple[tuple, Any]]] = WeakKeyDictionary()
"""Per module: name -> (its parameters' (storage, version) key, the packed copy, None or a pending Future)."""


def _background() -> ThreadPoolExecutor:
    global _packer
    if _packer is None:
        _packer = ThreadPoolExecutor(1, thread_name_prefix="pnyx-half-pack")
    return _packer


def packed_half(
    owner: Any,
    name: str,
    params: list[torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    wait: bool = True,
) -> Any | None:
    """fbgemm's packed float16 copy of `weight` (+ fp32 `bias`), or None: not float16-exact, or (`wait`
    False) still being packed.

    Cached for `owner` under `name` (in `_copies`, beside the module), keyed by each of `params`' storage
    and version counter (every in-place write through a parameter, `copy_`, `load_state_dict` or an
    optimizer step, bumps it), so a matrix is re-packed and re-checked only after its weights changed. A write that bypasses the parameter (through
    `.data`) is not seen: pnyx's writers all go through the parameter.

    Packing SmolLM2-135M takes ~1.3 s of CPU (fbgemm's prepack; the 28M-element head alone 0.7 s), after
    every version a worker installs. With `wait` False the packing runs on a background thread (the op
    releases the GIL) and this matrix multiplies in fp32 until it is done, so the first batch after an update
    does not stall on it. A pack started before a later write is keyed by the versions it started from and
    is never used for the newer weights.
    """
    key = tuple((p.data_ptr(), p._version) for p in params)
    held = _copies.setdefault(owner, {})  # beside the module, not on it: a deepcopy of the model copies none
    cached = held.get(name)
    if cached is not None and cached[0] == key:
        pending = cached[1]
        if not isinstance(pending, Future):
            return pending
        if not (wait or pending.done()):
            return None
        packed = pending.result()
        held[name] = (key, packed)
        return packed
    if wait:
        packed = _half_copy(weight, bias)
        held[name] = (key, packed)
        return packed
    held[name] = (key, _background().submit(_half_copy, weight, bias))
    return None


def _pack(
    owner: Any,
    name: str,
    linears: list[Any],
    fused: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    wait: bool = True,
) -> Any | None:
    """`packed_half` of one linear, or of `linears` stacked (`fused`: their `fused_linear` weight and bias)."""
    params = [p for m in linears for p in (m.weight, getattr(m, "bias", None)) if p is not None]
    weight, bias = fused if fused is not None else (linears[0].weight, getattr(linears[0], "bias", None))
    return packed_half(owner, name, params, weight, bias, wait)


def _mm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: Any | None) -> torch.Tensor:
    if packed is None:
        return F.linear(x, weight, bias)
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)


def left_pad(
    prompts: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P], attention mask [B, P] bool) with each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), width), dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attn[i, width - len(p) :] = True
    return ids.to(device), attn.to(device)


def _prefill_mask(attn: torch.Tensor) -> torch.Tensor:
    """[B, 1, P, P] bool: causal, real keys only, plus the diagonal so padded queries never see nothing."""
    width = attn.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=attn.device).tril()
    eye = torch.eye(width, dtype=torch.bool, device=attn.device)
    return ((causal & attn[:, None, :]) | eye)[:, None]


class FastSession:
    """Decode session over a Llama-shaped model's parameters with a preallocated, growable KV cache."""

    holes_ok = True
    holes_reason: str | None = None
    can_keep = True

    def __init__(self, model: PreTrainedModel, max_len: int, half_weights: bool | None = None):
        self.model = model
        self.body = model.model
        head = model.get_output_embeddings()
        if head is None:  # fast_path_supported models all have one
            raise ValueError(f"{type(model).__name__} has no output embeddings")
        self.head = head
        cfg = model.config
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.eps = cfg.rms_norm_eps
        self.qk_norm = cfg.model_type in QK_NORM_MODEL_TYPES
        self.device = next(model.parameters()).device
        self.dtype = self.body.embed_tokens.weight.dtype
        self.capacity = 0
        self._rotary(max(1, max_len))
        # Checked once per session: weights do not change while one batch is decoded.
        self.fused = [
            (
                fused_linear(
                    la.self_attn, "_pnyx_qkv", [la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj]
                ),
                fused_linear(la.mlp, "_pnyx_gate_up", [la.mlp.gate_proj, la.mlp.up_proj]),
            )
            for la in self.body.layers
        ]
        # None: wherever available, packed in the background after each change (fp32 until then);
        # True: required, packed before this session's first matmul
        wait = bool(half_weights)
        if half_weights is None:
            half_weights = half_weights_available(model)
        elif half_weights and not half_weights_available(model):
            raise ConfigError(
                "float16 weight copies need an fp32 model on the CPU and fbgemm in this torch build"
            )
        # fbgemm's float16 copies per layer (qkv, o, gate_up, down) and of the head; None = an fp32 matmul
        self.packed: list[tuple[Any, ...]] = [(None, None, None, None)] * len(self.fused)
        self.head_packed: Any | None = None
        if half_weights:
            self.packed = [
                (
                    _pack(
                        la.self_attn,
                        "_pnyx_qkv16",
                        [la.self_attn.q_proj, la.self_attn.k_proj, la.self_attn.v_proj],
                        qkv,
                        wait,
                    ),
                    _pack(la.self_attn, "_pnyx_o16", [la.self_attn.o_proj], wait=wait),
                    _pack(la.mlp, "_pnyx_gate_up16", [la.mlp.gate_proj, la.mlp.up_proj], gu, wait),
                    _pack(la.mlp, "_pnyx_down16", [la.mlp.down_proj], wait=wait),
                )
                for la, (qkv, gu) in zip(self.body.layers, self.fused, strict=True)
            ]
            self.head_packed = _pack(head, "_pnyx_head16", [head], wait=wait)

    def _rotary(self, capacity: int) -> None:
        """The rotary table for positions [0, capacity) (positions never exceed the slots used)."""
        dummy = torch.zeros(1, dtype=self.dtype, device=self.device)
        positions = torch.arange(capacity, device=self.device)[None]
        cos, sin = self.body.rotary_emb(dummy, positions)
        self.cos, self.sin = cos[0].to(self.dtype), sin[0].to(self.dtype)  # [capacity, head_dim]

    def _reserve(self, end: int) -> None:
        """Make room for cache slots [0, end): grow the cache (at least doubling) and the rotary table."""
        if end <= self.capacity:
            return
        cap = max(end, 2 * self.capacity)
        b = self.attn.shape[0]
        shape = (b, self.n_kv, cap, self.head_dim)
        used = self.length
        for li in range(len(self.k)):
            k = torch.empty(shape, dtype=self.dtype, device=self.device)
            v = torch.empty(shape, dtype=self.dtype, device=self.device)
            k[:, :, :used] = self.k[li][:, :, :used]
            v[:, :, :used] = self.v[li][:, :, :used]
            self.k[li], self.v[li] = k, v
        attn = torch.zeros(b, cap, dtype=torch.bool, device=self.device)
        attn[:, :used] = self.attn[:, :used]
        self.attn = attn
        if cap > self.cos.shape[0]:
            self._rotary(cap)
        self.capacity = cap

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor, start: int) -> torch.Tensor:
        """Hidden state of the last position [B, H]; writes K/V at cache slots [start, start + T)."""
        b, t = ids.shape
        end = start + t
        h = self.body.embed_tokens(ids)
        cos = self.cos[pos][:, :, None]  # [B, T, 1, D], broadcast over heads
        sin = self.sin[pos][:, :, None]
        nq, nkv = self.n_heads, self.n_kv
        for li, layer in enumerate(self.body.layers):
            attn, mlp = layer.self_attn, layer.mlp
            (w_qkv, b_qkv), (w_gu, b_gu) = self.fused[li]
            p_qkv, p_o, p_gu, p_down = self.packed[li]
            x = _rms_norm(h, layer.input_layernorm.weight, self.eps)
            qkv = _mm(x, w_qkv, b_qkv, p_qkv).view(b, t, nq + 2 * nkv, self.head_dim)
            qk = qkv[:, :, : nq + nkv]
            if self.qk_norm:  # Qwen3: RMSNorm over each head's vector, before rotary
                qk = torch.cat(
                    (
                        _rms_norm(qk[:, :, :nq], attn.q_norm.weight, self.eps),
                        _rms_norm(qk[:, :, nq:], attn.k_norm.weight, self.eps),
                    ),
                    dim=2,
                )
            qk = qk * cos + _rotate_half(qk) * sin  # rotary on queries and keys at once
            q = qk[:, :, :nq].transpose(1, 2)
            self.k[li][:, :, start:end] = qk[:, :, nq:].transpose(1, 2)
            self.v[li][:, :, start:end] = qkv[:, :, nq + nkv :].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q,
                self.k[li][:, :, :end],
                self.v[li][:, :, :end],
                attn_mask=mask,
                scale=attn.scaling,
                enable_gqa=nkv != nq,
            )
            o_proj, down = attn.o_proj, mlp.down_proj
            h = h + _mm(o.transpose(1, 2).reshape(b, t, -1), o_proj.weight, o_proj.bias, p_o)
            x = _rms_norm(h, layer.post_attention_layernorm.weight, self.eps)
            gate, up = _mm(x, w_gu, b_gu, p_gu).chunk(2, dim=-1)
            h = h + _mm(F.silu(gate) * up, down.weight, down.bias, p_down)
        return _rms_norm(h[:, -1], self.body.norm.weight, self.eps)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head_packed is None:
            return self.head(hidden)
        return torch.ops.quantized.linear_dynamic_fp16(hidden, self.head_packed)

    def prefill(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        b, width = ids.shape
        cap = max(self.cos.shape[0], width)
        shape = (b, self.n_kv, cap, self.head_dim)
        n_layers = len(self.body.layers)
        self.k = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(n_layers)]
        self.v = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(n_layers)]
        self.attn = torch.zeros(b, cap, dtype=torch.bool, device=self.device)
        self.capacity, self.length = cap, 0
        if cap > self.cos.shape[0]:
            self._rotary(cap)
        self.attn[:, :width] = attn
        pos = (attn.long().cumsum(-1) - 1).clamp(min=0)
        self.length = width
        hidden = self._forward(ids, pos, _prefill_mask(attn), 0)
        self.pos = pos[:, -1:]
        return self._logits(hidden)

    def step(self, tokens: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        self._reserve(self.length + 1)
        if live is None:
            self.pos = self.pos + 1
            self.attn[:, self.length] = True
        else:
            self.pos = self.pos + live[:, None].long()
            self.attn[:, self.length] = live
        self.length += 1
        mask = self.attn[:, None, None, : self.length]
        hidden = self._forward(tokens[:, None], self.pos, mask, self.length - 1)
        return self._logits(hidden)

    def extend(self, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        check_chunk(attn)
        r = ids.shape[1]
        start, end = self.length, self.length + r
        self._reserve(end)
        pos = chunk_positions(self.pos, attn)
        self.attn[:, start:end] = attn
        slots = torch.arange(end, device=self.device)
        causal = slots[None, :] <= (start + torch.arange(r, device=self.device))[:, None]  # [R, end]
        mask = (self.attn[:, None, :end] & causal[None])[:, None]  # [B, 1, R, end]
        self.length = end
        hidden = self._forward(ids, pos, mask, start)
        self.pos = pos[:, -1:]
        return self._logits(hidden)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only `rows` (a 1-D index tensor) of the batch; the cache is compacted up to the used length."""
        used = self.length
        for li in range(len(self.k)):
            k = torch.empty((len(rows), *self.k[li].shape[1:]), dtype=self.dtype, device=self.device)
            v = torch.empty_like(k)
            k[:, :, :used] = self.k[li][rows, :, :used]
            v[:, :, :used] = self.v[li][rows, :, :used]
            self.k[li], self.v[li] = k, v
        self.attn = self.attn[rows]
        self.pos = self.pos[rows]

    def take(self, rows: torch.Tensor) -> Parked:
        """A copy of `rows`' state (the session is unchanged: `keep` the others to remove them)."""
        used = self.length
        kv: list[tuple[torch.Tensor, torch.Tensor] | None] = [
            (k[rows, :, :used], v[rows, :, :used]) for k, v in zip(self.k, self.v, strict=True)
        ]
        return Parked(kv, self.attn[rows, :used], self.pos[rows])

    def merge(self, parked: list[Parked]) -> None:
        """Append parked rows after the current ones; their slots since they were taken become holes."""
        if not parked:
            return
        used, cap = self.length, self.capacity
        for li in range(len(self.k)):
            for which, store in ((0, self.k), (1, self.v)):
                parts = [store[li][:, :, :used]] + [pad_slots(p.layer(li)[which], used, 2) for p in parked]
                merged = torch.cat(parts)
                store[li] = torch.empty((merged.shape[0], *merged.shape[1:2], cap, merged.shape[3]),
                                        dtype=self.dtype, device=self.device)  # fmt: skip
                store[li][:, :, :used] = merged
        attn = torch.cat([self.attn[:, :used]] + [pad_slots(p.attn, used, 1) for p in parked])
        self.attn = pad_slots(attn, cap, 1)
        self.pos = torch.cat([self.pos] + [p.pos for p in parked])


def open_session(
    model: PreTrainedModel, max_len: int, fast: bool | None = None, half_weights: bool | None = None
) -> FastSession | HFSession:
    """A decode session for `model`; `fast=None` uses the fast path whenever it is supported, and
    `half_weights=None` its float16 weight copies wherever `half_weights_available` (fast path only)."""
    use_fast = fast_path_supported(model) if fast is None else fast
    if use_fast and not fast_path_supported(model):
        raise ConfigError(
            f"the fast decode path does not support model_type={model.config.model_type!r}: leave fast unset "
            "(it picks the generic path for such models)"
        )
    return FastSession(model, max_len, half_weights) if use_fast else HFSession(model, max_len)
