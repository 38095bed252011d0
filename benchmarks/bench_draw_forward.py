"""The draw check's share of the step's own forward (issue #25): a forward and backward of `completion_stats`
with and without seeded uniforms (`draw_distance` beside the sampling distribution), alternating, in one
process. Random prompts and completions of the given shape; the model is a folder (the shipped tiny model by
default; SmolLM2-135M from its dequantized GGUF folder).

    python benchmarks/bench_draw_forward.py                                   # tiny: 64 rows of 20 + 6
    python benchmarks/bench_draw_forward.py --model <SmolLM2 folder> --rows 32 --prompt 50 --completion 16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model", default=None, help="a model folder (default: the shipped tiny model)")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=20)
    p.add_argument("--completion", type=int, default=6)
    p.add_argument("--repeats", type=int, default=6)
    args = p.parse_args()
    import torch

    from pnyx.config import shipped_model_path
    from pnyx.models import load_model
    from pnyx.models.logprobs import completion_stats

    torch.manual_seed(0)
    model = load_model(args.model or shipped_model_path(), dtype="float32")
    vocab = int(model.config.vocab_size)
    prompts = [torch.randint(0, vocab, (args.prompt,)).tolist()] * args.rows
    comps = [torch.randint(0, vocab, (args.completion,)).tolist() for _ in range(args.rows)]
    us = [torch.rand(args.completion).tolist() for _ in range(args.rows)]

    def run(uniforms) -> float:
        t0 = time.perf_counter()
        out = completion_stats(
            model, prompts, comps, 1.0, with_entropy=True, with_var=True, uniforms=uniforms
        )
        out.logp.sum().backward()
        return time.perf_counter() - t0

    run(None), run(us)  # warm-up
    without = with_ = 0.0
    for i in range(args.repeats):  # alternate which goes first
        for arm in (None, us) if i % 2 else (us, None):
            dt = run(arm)
            if arm is None:
                without += dt
            else:
                with_ += dt
    print(
        f"vocabulary {vocab}, {args.rows} rows of {args.prompt} + {args.completion} tokens: forward and backward "
        f"{without / args.repeats:.3f} s without the draw distances, {with_ / args.repeats:.3f} s with: "
        f"{100 * (with_ - without) / without:+.1f}%"
    )


if __name__ == "__main__":
    main()
