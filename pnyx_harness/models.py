"""Tiny random models for tests: causal LMs of several architectures plus a real byte-level BPE tokenizer.

`make_tiny_model_dir` writes a Qwen2 folder in Hugging Face layout (config.json, model.safetensors,
generation_config.json, tokenizer.json, tokenizer_config.json, chat template) that `load_model` and
`load_tokenizer` read like any downloaded checkpoint. `tiny_arch_model` builds a tiny random model of
another architecture transformers ships (`TINY_ARCHS`: Qwen3, Gemma3, Gemma2, LFM2, SmolLM3, Phi3), sized
for the same tokenizer, with the features that stress a decoder kept on (sliding windows shorter than a
test's sequences, LFM2's conv layers, Gemma2's logit soft-cap, SmolLM3's layers without rotary).
`make_hub_cache` lays a model folder out as a hub download (so hub ids resolve offline in tests) and
`write_gguf` writes it as a real GGUF file (needs the `gguf` package). Nothing here touches the network:
the tokenizer is trained on a small built-in corpus with `tokenizers`, and the weights are random from a
seeded generator.

Invariant: the same arguments always produce the same tokenizer and bit-identical weights, so tests that
compare two runs (or two processes) see the same model. Knows nothing about the store or RL.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from pnyx.models.loading import DType

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]

# A Qwen-style chat template, small enough to read: each message is wrapped in im_start/im_end and the
# generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the BPE merges: the words and tags the built-in environments use, so common tokens
# (digits, tags, answer markup) get merges and a stop string like "</search>" spans several tokens.
_CORPUS = [
    "What is 12 + 7? Answer with a number. <answer>19</answer>",
    "Compute 3 * 4 - 5 and put the result in <answer></answer> tags. The answer is 7.",
    "Use the numbers 2, 3, 7, 9 to make 24. <answer>(9 - 3) * (7 - 3)</answer>",
    "<search>capital of France</search> <information>Paris is the capital of France.</information>",
    "<search>who wrote Hamlet</search> <information>Hamlet is a tragedy by William Shakespeare.</information>",
    "Let me think step by step. First, add the tens. Then add the ones. So the total is 42.",
    "The quick brown fox jumps over the lazy dog. A question, an answer, a search, a result.",
    "user assistant system You are a helpful assistant. Question: Answer: Reasoning:",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 100 1000",
    "+ - * / = ( ) < > [ ] { } , . ; : ! ? ' \" # the of and to in is it that for on with as",
]


def build_tiny_tokenizer(vocab: int = 512):
    """A byte-level BPE `PreTrainedTokenizerFast` with `vocab` entries (>= 259), chat template and EOS.

    Byte-level, so any text round-trips (tool replies may contain anything). Deterministic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab={vocab} is too small for a byte-level tokenizer; use at least 259")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def tiny_qwen2_config(
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int | None = None,
    max_positions: int = 2048,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
):
    """A small `Qwen2Config` (tied embeddings); defaults give ~0.1M parameters for vocab 512."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )


def make_tiny_model_dir(
    path: str | Path,
    vocab: int = 512,
    seed: int = 0,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    init_std: float = 0.1,
) -> Path:
    """Write a tiny random Qwen2 model and its tokenizer to `path` (created) and return the folder.

    `init_std` is larger than the usual 0.02 so the random model's next-token distributions are peaked
    enough for top-k/top-p truncation and stop strings to matter in tests.
    """
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer(vocab)
    eos_id = cast(int, tokenizer.convert_tokens_to_ids(EOS_TOKEN))  # one token in, one id out
    pad_id = cast(int, tokenizer.convert_tokens_to_ids(PAD_TOKEN))
    config = tiny_qwen2_config(
        len(tokenizer), hidden, layers, heads, kv_heads, eos_token_id=eos_id, pad_token_id=pad_id
    )
    config.initializer_range = init_std
    # Seed, build on CPU in fp32: bit-identical weights for the same arguments on any machine.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.eval()
    model.save_pretrained(out)
    GenerationConfig(eos_token_id=[eos_id], pad_token_id=pad_id).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_hub_cache(
    hf_home: str | Path, repo_id: str, model_dir: str | Path, ref: str = "main", commit: str | None = None
) -> str:
    """Put the files of `model_dir` into `$HF_HOME/hub` exactly as huggingface_hub lays a download out.

    `models--{org}--{name}/blobs/<hash>` holds each file once (named by its sha256, as the hub names LFS
    blobs), `snapshots/<commit>/<file>` are relative symlinks to the blobs, and `refs/<ref>` names the
    commit. The commit is derived from the files (or given), so the same folder gives the same commit.
    Returns the commit hash. Calling it again with other files and the same `ref` moves the ref, as a
    new push followed by a download would.
    """
    import hashlib
    import os

    src = Path(model_dir)
    files = sorted(p for p in src.iterdir() if p.is_file())
    repo = Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))
    if commit is None:
        h = hashlib.sha1()
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        commit = h.hexdigest()
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        link = snapshot / f.name
        if not link.exists():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs" / ref).write_text(commit)  # the hub library writes the bare hash, no newline
    return commit


def write_gguf(model_dir: str | Path, out_file: str | Path) -> Path:
    """Write the Qwen2 model in `model_dir` (e.g. `make_tiny_model_dir`'s) as an f32 GGUF file with the
    tokenizer metadata transformers' GGUF loader reads (byte-level BPE vocabulary, merges, token types,
    EOS/PAD ids, chat template). Tensors are named with gguf's own HF → GGUF name map; Qwen2 needs no
    permutation, so the file holds the model's exact fp32 values."""
    import json

    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(model_dir)
    model = AutoModelForCausalLM.from_pretrained(src, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(src, local_files_only=True)
    cfg = model.config
    if cfg.model_type != "qwen2":
        raise ValueError(f"write_gguf writes qwen2 models only, got {cfg.model_type!r}")
    arch = gguf.MODEL_ARCH.QWEN2
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(out_file), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name(src.name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    added = {t.content for t in tok.added_tokens_decoder.values()}
    merges = json.loads((src / "tokenizer.json").read_text())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")  # the Qwen2 split regex the folder's tokenizer uses
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in added else gguf.TokenType.NORMAL for t, _ in vocab]
    )
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tok.eos_token_id)
    if tok.pad_token_id is not None:
        writer.add_pad_token_id(tok.pad_token_id)
    if tok.chat_template:
        writer.add_chat_template(tok.chat_template)
    for key, value in model.state_dict().items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: GGUF omits the output matrix and the loader re-ties it
        base, suffix = key.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", value.detach().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out_file)


# Per architecture: the config fields beyond the shared tiny shape. Windows of 6 and conv kernels of 3 are
# shorter than any test's prompt + completion, so the sliding and conv code paths really run.
TINY_ARCHS: dict[str, dict] = {
    "qwen3": {},
    "gemma3_text": dict(
        sliding_window=6, layer_types=["sliding_attention", "sliding_attention", "full_attention"]
    ),
    "gemma2": dict(
        sliding_window=6, layer_types=["sliding_attention", "full_attention", "sliding_attention"]
    ),
    "lfm2": dict(
        layer_types=["conv", "full_attention", "conv"],
        conv_L_cache=3,
        block_ff_dim=128,
        block_auto_adjust_ff_dim=False,
    ),
    "smollm3": dict(no_rope_layers=[1, 1, 0]),
    "phi3": {},
}


def tiny_arch_model(model_type: str, tokenizer, seed: int = 0, dtype: DType = "float32", device: str = "cpu"):
    """A tiny random causal LM of `model_type` (a `TINY_ARCHS` key) for `tokenizer` (3 layers, hidden 64,
    4 heads / 2 KV heads of dim 16, tied embeddings, init std 0.1), in eval mode. Seeded."""
    from pnyx.models.loading import model_from_config

    if model_type not in TINY_ARCHS:
        raise ValueError(f"no tiny config for {model_type!r}; known: {sorted(TINY_ARCHS)}")
    config = dict(
        model_type=model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, initializer_range=0.1, tie_word_embeddings=True, **TINY_ARCHS[model_type],
    )  # fmt: skip
    return model_from_config(config, dtype=dtype, device=device, seed=seed)
