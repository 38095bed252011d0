"""Harnesses for pnyx's tests and benchmarks: never imported by the library (`pnyx/`).

- `arena`, `attacks`: the attack suite's arena (a real trainer in process, honest and hostile uploaders)
  and its attackers (`benchmarks/bench_attacks.py`, `tests/test_attacks.py`);
- `swarm_experiment`: specialist start checkpoints, held-out reward, round-robin swarm runs
  (`benchmarks/bench_swarm*.py`);
- `models`: tiny random models and tokenizers in Hugging Face layout, hub caches and GGUF files for tests;
- `faults`, `proxy`: a store that fails on purpose, and an HTTP proxy that does it to a real S3 server;
- `trainer`: `python -m pnyx_harness.trainer [--crash-at POINT:N[@RANK]] [--ingest-delay-s X] ARGS` runs
  `pnyx trainer ARGS` with a kill at a named point of a step, or every group fetch slowed down
  (`pnyx.train.hooks`).

The import contracts in pyproject.toml (`lint-imports`, run by .ci/run) forbid `pnyx` from importing
this package.
"""
