#!/bin/bash
# SmolLM2 recipe with an UNTRUSTED worker: trainer and worker started apart (pnyx run trusts its own worker)
# usage: ut_run.sh NAME [STEPS] [trainer settings...], e.g. ut_run.sh ut3 2 --security.standing_groups=0
cd /tmp/sr
R=runs/$1; STEPS=${2:-30}; shift; shift || true
rm -rf $R
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 pnyx trainer --store $R --config /work/main/examples/smollm2-135m.toml --steps $STEPS "$@" > $(basename $R).trainer.log 2>&1 &
T=$!
sleep 5
OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 pnyx worker --store $R --id w1 --threads 1 > $(basename $R).worker.log 2>&1 &
W=$!
wait $T
echo "trainer rc=$?"
kill -TERM $W; wait $W
python /work/main/benchmarks/draw_run_summary.py $R
