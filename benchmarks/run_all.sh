#!/usr/bin/env bash
# Re-creates every committed result under benchmarks/results/ (CPU; about 20 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
out=benchmarks/results
# Look-ahead L against Belady's optimum (how CacheConfig's default L was chosen), LRU and LFU.
sweep="--policies optimal,lookahead,lru,lfu --lookahead 8,16,32,64,128,256 --prefetch-depth 1"
$PY benchmarks/cache_policies.py --trace movielens --batch 64 --capacity 0.2,0.3 $sweep \
    --json $out/lookahead_sweep_movielens.json
$PY benchmarks/cache_policies.py --trace zipf:rows=1e5,alpha=1.05,batch=256,batches=600 \
    --capacity 0.05,0.1 $sweep --json $out/lookahead_sweep_zipf1e5_a1.05.json
$PY benchmarks/cache_policies.py --trace zipf:rows=1e6,alpha=0.9,batch=8192,batches=200 \
    --capacity 0.05,0.1 $sweep --json $out/lookahead_sweep_zipf1e6_a0.9.json
# A large cache in steady state (the last 500 of 2,000 batches) and early (batches 250-400),
# beside the planner's loads for it (--model).
$PY benchmarks/cache_policies.py --trace zipf:rows=2e7,alpha=1.05,batch=20000,batches=2000 \
    --capacity 1000000 --policies optimal,lookahead,lru,lfu --lookahead 16,64,128,256,512 \
    --steady-after 1500 --model --json $out/steady_zipf2e7_b2000.json
$PY benchmarks/cache_policies.py --trace zipf:rows=2e7,alpha=1.05,batch=20000,batches=400 \
    --capacity 1000000 --policies optimal,lookahead,lru --lookahead 64 --steady-after 250 \
    --model --json $out/steady_zipf2e7_b400.json
$PY benchmarks/engine_throughput.py --skip ops,host --json $out/engine_throughput.json
$PY benchmarks/engine_throughput.py --skip scheduler,fwd,bytes --json $out/engine_ops_cpu.json
$PY benchmarks/planner_stats.py --json $out/planner_stats.json
$PY benchmarks/throughput.py --ranks 1 --threads 1 --warmup 30 --steps 60 \
    --sync-capacities 0.05 --hook-capacities 0.05 --json $out/throughput_cpu_1rank.json
$PY benchmarks/throughput.py --ranks 2 --threads 1 --warmup 30 --steps 60 \
    --json $out/throughput_cpu_2ranks.json
$PY benchmarks/throughput.py --ranks 2 --threads 1 --warmup 30 --steps 60 --small-tables resident \
    --json $out/throughput_cpu_2ranks_resident.json
$PY benchmarks/planner.py --threads 1 --json $out/planner_cpu.json
# Planning 1,000 tables on 128 ranks (issue 35: <= 3 s), beside the machine's reference workload.
$PY benchmarks/planner_speed.py --runs 5 --json $out/planner_speed_cpu.json
# Where the scheduling's host work could go: inline, a thread, a process (issue 33).
for i in 1 2 3; do
    $PY benchmarks/host_overlap.py --device cpu --scale 1000 --batch 256 --steps 60 --rounds 3 \
        --warmup 10 --threads 1 --json $out/host_overlap_cpu/run$i.json
done
# Hot rows (sequence and pooled tables): distcache's plan, the same without, TorchRec's plan.
# (the cpu preset: calibrated at 59d4f57, the planner replicates no row of this workload)
$PY benchmarks/hot_rows.py --rounds 5 --steps 20 --json $out/hot_rows_sequence_cpu_2ranks.json
$PY benchmarks/hot_rows.py --calibrate --pooled --tables 8 --rows 2e5 --pooling 1 --batch-size 2048 --rounds 5 --steps 20 \
    --json $out/hot_rows_pooled_dim512_cpu_2ranks.json
