"""PULSE benchmark: delta size vs the entropy bound and vs value encoding, codec speed vs memcpy, cold join.

A Qwen2-shaped model (random init, ~100M parameters by default) is trained with AdamW at lr 1e-6 on random
tokens with fp32 master weights; after every step the bf16 cast is published to a local-folder store. Per
step it prints: the changed fraction, delta bytes / full bf16 bytes, the entropy bound / full bytes and the
delta's ratio to it, the same positions encoded with new values instead of differences (and the ratio),
encode and decode GB/s of the full state next to a memcpy of the same bytes (decode twice: into fresh
arrays, as a one-step sync does, and into the arrays of the state rebuilt one step earlier, as every later
step of a multi-step route does and as a preallocated memcpy does), the same round trip with the numpy
kernels on the same step when the compiled ones are in force (`pnyx.weights.kernels`; "vs numpy" is their
time over the compiled kernels' time, both into reused arrays), the decode into arrays that already hold
the base ("dec inpl": only the changes are added, `DeltaApplier(in_place=...)`, as a route's later steps
do; the copy of the base into them is not timed) and its round trip, and the int8 plane's code change
fraction and delta size. At the end: the cold join time (anchor + all deltas) from the store.

    python benchmarks/bench_pulse.py                       # ~100M params, 11 versions (anchor + 10 deltas)
    python benchmarks/bench_pulse.py --hidden 256 --heads 4 --kv-heads 2 --layers 2 --vocab 4096 --steps 4  # a quick look

Knows nothing about RL; the model is only a realistic source of weight updates.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10, help="training steps = deltas after the anchor")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--threads", type=int, default=2, help="torch threads for the training steps")
    p.add_argument("--codec-threads", type=int, default=None, help="codec threads (default: the codec's own)")
    p.add_argument(
        "--level", type=int, default=1, help="zstd level of the delta frames (publisher and codec)"
    )
    p.add_argument(
        "--no-baseline", action="store_true", help="skip timing the numpy kernels beside the compiled ones"
    )
    p.add_argument("--store", type=str, default=None, help="local folder for the store (default: a temp dir)")
    return p.parse_args()


def memcpy_gbps(state: dict) -> float:
    """GB/s of copying every tensor's bytes into preallocated buffers (best of 3)."""
    src = [tb.data.reshape(-1) for tb in state.values()]
    dst = [np.empty_like(a) for a in src]
    nbytes = sum(a.nbytes for a in src)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for d, s in zip(dst, src, strict=True):
            np.copyto(d, s)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def bounds(old: dict, new: dict, threads: int) -> dict[str, float]:
    """Seconds, on one thread, best of 3 over the whole state: the encode kernel alone (`kernels.diff_codes`
    per tensor, no zstd, no packing), a memcpy of one state, and a pass that reads both states and writes
    nothing (a wrapping sum of each as 64-bit words: vectorized, so bound by the reads). Then the last two
    on `threads` threads (each tensor cut in `threads` slices): the least traffic any encode (read both
    states) and any decode into fresh arrays (write one state from the other) must move."""
    from concurrent.futures import ThreadPoolExecutor

    from pnyx.weights import kernels

    pairs = [(old[k].data.reshape(-1), new[k].data.reshape(-1)) for k in new if k in old]

    def words(x: np.ndarray) -> np.ndarray:
        n = x.nbytes - x.nbytes % 8
        return x.view(np.uint8)[:n].view(np.uint64)

    dst = [np.empty_like(b) for _, b in pairs]

    def best(fn) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    def sliced(x: np.ndarray) -> list[np.ndarray]:  # cut at 8-byte boundaries: aligned 64-bit views
        cuts = [len(x) * i // threads // 4 * 4 for i in range(1, threads)]
        return np.split(x, cuts)

    triples = [
        (d, a, b)
        for dst_t, (a_t, b_t) in zip(dst, pairs, strict=True)
        for d, a, b in zip(sliced(dst_t), sliced(a_t), sliced(b_t), strict=True)
    ]
    with ThreadPoolExecutor(threads) as pool:  # numpy's sum and copyto release the GIL
        return {
            "kernel": best(lambda: [kernels.diff_codes(a, b) for a, b in pairs]),
            "memcpy": best(lambda: [np.copyto(d, b) for d, (_, b) in zip(dst, pairs, strict=True)]),
            "read_both": best(lambda: [(words(a).sum(), words(b).sum()) for a, b in pairs]),
            "memcpy_par": best(lambda: list(pool.map(lambda t: np.copyto(t[0], t[2]), triples))),
            "read_both_par": best(
                lambda: list(pool.map(lambda t: (words(t[1]).sum(), words(t[2]).sum()), triples))
            ),
        }


def main() -> None:
    args = parse()
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from pnyx.store import open_store
    from pnyx.weights import Publisher, Syncer, kernels
    from pnyx.weights import int8 as q8
    from pnyx.weights.apply import apply_delta
    from pnyx.weights.bits import from_torch
    from pnyx.weights.codec import (
        DeltaStats,
        default_threads,
        encode_delta,
        entropy_bound_bytes,
        expected_of,
    )

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(512, args.seq),
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(cfg)
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def bf16_bits() -> dict:
        return from_torch({k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()})

    folder = args.store or tempfile.mkdtemp(prefix="bench-pulse-")
    store = open_store(folder)
    pub = Publisher(store, anchor_every=10**6, int8_plane=True, level=args.level)
    old = bf16_bits()
    full = sum(tb.nbytes for tb in old.values())
    pub.publish_bits(0, old)
    grid = q8.make_grid(old)
    old8, grid = q8.quantize(old, grid)
    full8 = sum(tb.nbytes for tb in old8.values())
    print(
        f"model: Qwen2 {nparams / 1e6:.1f}M params ({len(old)} tensors), full bf16 state {full / 1e6:.1f} MB, "
        f"int8 plane {full8 / 1e6:.1f} MB; AdamW lr={args.lr:g}, batch {args.batch}x{args.seq}, "
        f"{args.threads} threads, codec threads {args.codec_threads or default_threads()}, zstd level {args.level}, "
        f"PULSE kernels {kernels.KERNELS}; "
        f"store {folder}"
    )
    hdr = (
        f"{'step':>4} {'changed':>8} {'delta/full':>10} {'bound/full':>10} {'delta/bound':>11} "
        f"{'values/full':>11} {'delta/values':>12} {'enc GB/s':>8} {'dec GB/s':>8} {'dec reuse':>9} {'memcpy':>7} "
        f"{'rt/memcpy':>9} {'rt reuse':>8} {'dec inpl':>8} {'rt inpl':>7} {'vs numpy':>8} {'int8 chg':>8} {'int8 d/full':>11} {'train s':>7} {'pub s':>6}"
    )
    print(hdr)
    rows = []
    spare: dict = {}  # the arrays of the state rebuilt one step earlier (nothing reads them any more)
    mirror = {k: tb.data.copy() for k, tb in old.items()}  # arrays holding the base (untimed copies)
    ct = args.codec_threads
    bound_threads = ct or default_threads()
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_s = time.perf_counter() - t
        new = bf16_bits()

        stats = DeltaStats()
        t = time.perf_counter()
        chunks = list(encode_delta(old, new, level=args.level, stats=stats, threads=ct))
        enc_s = time.perf_counter() - t
        t = time.perf_counter()
        rebuilt = apply_delta(old, chunks, expected_of(new), threads=ct)
        dec_s = time.perf_counter() - t
        t = time.perf_counter()
        reused = apply_delta(old, chunks, expected_of(new), reuse=spare, threads=ct)
        reuse_s = time.perf_counter() - t
        for k, tb in old.items():
            np.copyto(mirror[k], tb.data)
        t = time.perf_counter()
        in_place = apply_delta(old, chunks, expected_of(new), threads=ct, in_place=mirror)
        inplace_s = time.perf_counter() - t
        for got in (rebuilt, reused, in_place):
            if any(not np.array_equal(got[k].data, new[k].data) for k in new):
                raise SystemExit("round trip is not bit-exact")
        base_rt = float("nan")  # the numpy kernels on the same step, into the same (reused) arrays
        if kernels.KERNELS == "numba" and not args.no_baseline:
            kernels.use("numpy")
            t = time.perf_counter()
            np_chunks = list(encode_delta(old, new, level=args.level, threads=ct))
            np_enc_s = time.perf_counter() - t
            target = {k: tb.data for k, tb in reused.items() if tb is not old.get(k)}
            t = time.perf_counter()
            np_dec = apply_delta(old, np_chunks, expected_of(new), reuse=target, threads=ct)
            np_dec_s = time.perf_counter() - t
            kernels.use("numba")
            if np_chunks != chunks or any(not np.array_equal(np_dec[k].data, new[k].data) for k in new):
                raise SystemExit("the numpy and numba kernels disagree")
            base_rt = (enc_s + reuse_s) and (np_enc_s + np_dec_s) / (enc_s + reuse_s)
        spare = {k: tb.data for k, tb in rebuilt.items() if tb is not old.get(k)}
        delta = sum(map(len, chunks))
        values = sum(map(len, encode_delta(old, new, mode="value", level=args.level)))
        bound = entropy_bound_bytes(old, new)
        mem = memcpy_gbps(new)

        new8, grid = q8.quantize(new, grid)
        int8_changed = q8.code_change_fraction(old8, new8)
        int8_delta = sum(map(len, encode_delta(old8, new8, level=args.level)))

        t = time.perf_counter()
        pub.publish_bits(step, new)
        pub_s = time.perf_counter() - t
        r = dict(
            changed=stats.changed / stats.elements,
            delta=delta / full,
            bound=bound / full,
            d_bound=delta / bound if bound else float("nan"),
            values=values / full,
            d_values=delta / values,
            enc=full / enc_s / 1e9,
            dec=full / dec_s / 1e9,
            dec_r=full / reuse_s / 1e9,
            mem=mem,
            rt=(full / (enc_s + dec_s) / 1e9) / mem,
            rt_r=(full / (enc_s + reuse_s) / 1e9) / mem,
            dec_i=full / inplace_s / 1e9,
            rt_i=(full / (enc_s + inplace_s) / 1e9) / mem,
            vs_np=base_rt,
            int8=int8_changed,
            int8_d=int8_delta / full8,
        )
        rows.append(r)
        print(
            f"{step:>4} {100 * r['changed']:>7.3f}% {100 * r['delta']:>9.3f}% {100 * r['bound']:>9.3f}% "
            f"{r['d_bound']:>11.3f} {100 * r['values']:>10.3f}% {r['d_values']:>12.3f} {r['enc']:>8.2f} "
            f"{r['dec']:>8.2f} {r['dec_r']:>9.2f} {r['mem']:>7.2f} {r['rt']:>9.3f} {r['rt_r']:>8.3f} {r['dec_i']:>8.2f} {r['rt_i']:>7.3f} {r['vs_np']:>7.2f}x {100 * r['int8']:>7.3f}% "
            f"{100 * r['int8_d']:>10.3f}% {train_s:>7.2f} {pub_s:>6.2f}",
            flush=True,
        )
        if step == args.steps:
            limits = bounds(old, new, bound_threads)
        old, old8 = new, new8

    t = time.perf_counter()
    syn = Syncer(open_store(folder))
    version, _ = syn.sync()
    cold_s = time.perf_counter() - t
    ok = syn.digest == pub._digest
    moved = syn.last_route.nbytes if syn.last_route else 0
    print(
        f"cold join: anchor + {version} deltas ({moved / 1e6:.1f} MB) from the local folder in {cold_s:.2f} s, "
        f"digest {'matches' if ok else 'DIFFERS'}"
    )

    print(
        f"what bounds the encode (last step, one thread, {full / 1e6:.0f} MB per state): the compare kernel alone "
        f"{limits['kernel'] * 1e3:.1f} ms, reading both states {limits['read_both'] * 1e3:.1f} ms, "
        f"a memcpy of one {limits['memcpy'] * 1e3:.1f} ms: kernel / read both = "
        f"{limits['kernel'] / limits['read_both']:.2f}, kernel / memcpy = {limits['kernel'] / limits['memcpy']:.2f}"
    )
    print(
        f"the traffic ceiling (codec threads {bound_threads}): reading both states {limits['read_both_par'] * 1e3:.1f} ms "
        f"(the least an encode reads) + a memcpy {limits['memcpy_par'] * 1e3:.1f} ms (the least a decode into "
        f"fresh arrays moves): a round trip that did nothing else would be "
        f"{limits['memcpy'] / (limits['read_both_par'] + limits['memcpy_par']):.3f}x the one-thread memcpy"
    )
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(
        f"median: changed {100 * med['changed']:.3f}%  delta {100 * med['delta']:.3f}% of full  "
        f"delta/bound {med['d_bound']:.3f} (goal <= 1.2)  delta/values {med['d_values']:.3f} (goal <= 0.65)  "
        f"enc {med['enc']:.2f} GB/s dec {med['dec']:.2f} GB/s (into reused arrays {med['dec_r']:.2f}) "
        f"memcpy {med['mem']:.2f} GB/s  round trip/memcpy {med['rt']:.3f} (reused arrays {med['rt_r']:.3f}; "
        f"in place {med['dec_i']:.2f} GB/s, round trip {med['rt_i']:.3f}; "
        f"goal >= 0.5; {med['vs_np']:.2f}x the numpy kernels' round trip)  int8 codes changed {100 * med['int8']:.3f}% "
        f"int8 delta {100 * med['int8_d']:.3f}% of the int8 plane"
    )


if __name__ == "__main__":
    main()
