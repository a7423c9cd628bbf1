#!/usr/bin/env bash
# One GPU (issues 11 and 12): the CUDA tests and the measurements.
#
# A session drawn for a GPU now has 15 minutes of device time, machine start (a few minutes)
# included, so run the `quick` stage first, in one command: it does issue 11's GPU checks in
# order of importance within a budget of its own (QUICK_SECONDS, default 420 s), each step under
# a time limit cut to what is left, and skips what no longer fits:
#     run(command="bash benchmarks/gpu_session.sh quick", carry=[".fbg", ".whl"], timeout_s=480)
# (without .whl the TorchRec tests skip, without .fbg the FBGEMM variants; the rest runs). At
# most 7 files come back under $OUT (the device tool returns 8). If device time is left, the
# stages below go on, one per call.
#
# Before, on a machine that reaches the package registry, at the project root: pack FBGEMM's
# CUDA build for an H100/H200 into .fbg/ (~54 MB) and fill .whl/ with TorchRec without
# fbgemm-gpu-cpu (~3 MB; both git-ignored):
#     bash ../shared/device/fbgemm_cuda.sh && CUDA_FBGEMM=1 bash ../shared/device/wheels.sh
# (.whl alone, from plain `wheels.sh`, brings fbgemm-gpu-cpu instead: TorchRec's CPU ops only.)
# Every stage that needs them unpacks .fbg into /tmp/site first, then installs .whl there.
# Then with the device tool, from the project root, one call per stage, in this order:
#     run(command="bash benchmarks/gpu_session.sh fbgemm",   carry=[".fbg", ".whl"], timeout_s=600)
#     run(command="bash benchmarks/gpu_session.sh tests",    carry=[".fbg", ".whl"], timeout_s=600)
#     run(command="bash benchmarks/gpu_session.sh headline", carry=[".fbg"],         timeout_s=600)
#     run(command="bash benchmarks/gpu_session.sh kaggle",   carry=[".fbg", ".whl"], timeout_s=600)
#     run(command="bash benchmarks/gpu_session.sh direct",                           timeout_s=600)
# and, where device time is left (the engine on the GPU alone, beside nn.EmbeddingBag there):
#     run(command="bash benchmarks/gpu_session.sh engine",                   timeout_s=600)
# Each stage writes its logs and JSON under $OUT (the device tool's output folder; ./gpu_out
# elsewhere) and exits non-zero if a step failed, after running the others. Commit the JSON
# under benchmarks/results/ with the device named (the files record the command and machine).
#
# Stages:
#   quick     for a 15-minute device session: pytest tests/gpu (sync debug mode 'error',
#             run-ahead, CUDA == CPU; not test_calibrate_cuda.py, the last step) <= 150 s; gpu_headline.py at Criteo Terabyte's size
#             (188 M rows, 48 GB of host rows), batches of 4096, 2 %, the caches full (about
#             530 steps) before 200 timed steps: FBGEMM's TBE with all rows on the device
#             (TorchRec's fused), distcache (its CUDA defaults: graphs, direct staging),
#             FBGEMM's UVM cache without and with prefetching (fused_uvm_caching), all rows on
#             the device in nn.EmbeddingBag, LRU, embeddings on the CPU, the worker thread's
#             staging (distcache_worker), without CUDA graphs (distcache_eager) <= 270 s; then
#             engine_throughput.py on the GPU with what is left: forward + backward at 100/5/1 %,
#             ops per step, and host ms per step at negligible compute (is the host the
#             bottleneck: each op a kernel launch?); `distcache calibrate` of the GPU
#             (--quick: every figure of the GPU cost model, the framework's per-step costs
#             under TorchRec's DMP where .fbg and .whl came; an estimated 30-60 s) for
#             benchmarks/planner_vs_gpu.py and the h100/h200 presets                     ~7 min
#   fbgemm    issue 33's comparison: a small run of the FBGEMM variants first (checks them
#             before the big ones), then at Criteo Terabyte's size, batches of 4096, 200 timed
#             steps: FBGEMM's TBE with all rows on the device, distcache, FBGEMM's UVM cache
#             without and with prefetching at 2 % (FBGEMM_CAPACITIES), with SGD and then with
#             row-wise Adagrad                                                          ~9 min
#   tests     pytest tests/gpu (TorchRec ones need .whl), host-sync report, a small CUDA run of
#             gpu_headline.py (checks the script before the big run)                  ~4 min
#   headline  gpu_headline.py at Criteo Terabyte size (48 GB of rows in host memory): its
#             default variants (FBGEMM's TBE all on the device and its UVM cache with and
#             without prefetching, distcache, lru at 2 %, nn.EmbeddingBag on the device,
#             embeddings on the CPU); then distcache and FBGEMM's UVM caches at 1 %     ~9 min
#   kaggle    throughput.py --device cuda (TorchRec DMP; see its notes below), and the same
#             comparison without TorchRec: gpu_headline.py --tables kaggle at 100/5/2/1 % + lru
#             at 5/2 % + FBGEMM's three + device + cpu_embeddings                       ~8 min
#   direct    the two staging designs (issue 11) at Criteo Terabyte size, 2 %: the staging
#             stream addressing pinned host rows (distcache, the CUDA default) and the worker
#             thread (distcache_worker); then the same at Kaggle size, dim 16            ~7 min
#   engine    engine_throughput.py --device cuda: one 5M x 64 table, forward + backward at
#             100/5/1 % (fp16, direct staging, LRU) against nn.EmbeddingBag on the GPU
#             (issue 11's 5 % against 100 % target), ops and host ms per step, the
#             scheduler's ids/s at L = 8/64/256                                       ~3 min
#
# throughput.py on this machine: its 'torchrec' variant needs FBGEMM's CUDA kernels (.fbg;
# with fbgemm-gpu-cpu only, its batches' KeyedJaggedTensors on the GPU make TorchRec's FBGEMM
# ops fail). It runs under a time limit so its log shows where it stops; the kaggle stage's
# gpu_headline.py run measures the same variants without TorchRec.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
status=0
# GPU_SESSION_CHECK=FILE: append each step's command line to FILE (shell-quoted, one a line)
# instead of running it, and install nothing: tests/test_gpu_session.py checks every stage's
# commands against the scripts' own argument parsers on a CPU, before they cost device time.
CHECK=${GPU_SESSION_CHECK:-}

DEADLINE=0  # quick: seconds since the epoch when its budget ends (0: no budget)

step() {  # step NAME SECONDS CMD...: run CMD under a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    if [ -n "$CHECK" ]; then
        printf '%q ' "$@" >>"$CHECK" && echo >>"$CHECK"
        return
    fi
    if [ "$DEADLINE" -gt 0 ]; then  # cut the limit to the budget left; skip under 30 s
        local left=$((DEADLINE - $(date +%s)))
        if [ "$left" -lt 30 ]; then
            echo "== $name SKIPPED: ${left}s of the budget left"
            status=1
            return
        fi
        [ "$left" -lt "$limit" ] && limit=$left
    fi
    echo "== $name ($(date +%T), limit ${limit}s): $*"
    timeout --kill-after=20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local code=${PIPESTATUS[0]}
    if [ "$code" -ne 0 ]; then
        echo "== $name FAILED (exit $code$([ "$code" -eq 124 ] && echo ', time limit')): $OUT/$name.log"
        status=1
    fi
}

gpu_tests() {  # gpu_tests NAME SECONDS [ARGS...]: tests/gpu, the sync and run-ahead checks first,
    # each test's outcome as it ends (-v) and the failures' messages at the end of each run
    # (-rfEs), so that a run cut by its limit still names what failed (2026-11-28: a quiet
    # run cut at 190 s showed two F among 66 dots and nothing else)
    local name=$1 limit=$2
    shift 2
    local first="tests/gpu/test_overlap_cuda.py tests/gpu/test_transfer_cuda.py tests/gpu/test_lane_cuda.py"
    step "$name" "$limit" bash -c "$PY -m pytest $first -v -p no:cacheprovider -rfEs --tb=short; \
        a=\$?; $PY -m pytest tests/gpu ${first//tests/--ignore=tests} $* -v -p no:cacheprovider \
        -rfEs --tb=short; b=\$?; exit \$((a | b))"
}

throughput_kaggle() {  # throughput.py on one GPU at Kaggle's sizes (issue36 and verify)
    step throughput_kaggle 170 $PY benchmarks/throughput.py --device cuda --ranks 1 --scale 1 \
        --batch 4096 --capacities 1.0,0.02 --uvm-capacities 0.02 --lru-capacities "" \
        --torchrec-prefetch-capacities 0.02 \
        --no-cpu-embeddings --warmup 20 --steps 50 --threads 8 --timeout 160 --phases \
        --json "$OUT/throughput_cuda_kaggle.json"
}

FBG=.fbg/fbgemm_gpu-1.6.0-sm90.tar.zst  # made by ../shared/device/fbgemm_cuda.sh

install_packages() {  # the install prefixes of fbgemm_cuda.sh (.fbg), then of wheels.sh (.whl)
    [ -n "$CHECK" ] && return
    local fbgemm=0 wheels=()
    mkdir -p /tmp/site
    # (FBGEMM's CUDA build unpacked by an earlier call on this machine is kept: its marker,
    # which fbgemm-gpu-cpu installed from .whl into the same folder does not leave)
    if [ ! -e /tmp/site/.fbgemm_cuda ]; then
        local src=() z
        z=$(command -v zstd || echo .fbg/zstd)
        if [ -s "$FBG" ]; then
            src=("$FBG")
        elif [ -s /tmp/fbgparts/x00 ] && [ -s .fbg2/x01 ]; then  # see `unpack` below
            src=(/tmp/fbgparts/x00 .fbg2/x01)
            command -v zstd >/dev/null || z=/tmp/fbgparts/zstd
        fi
        if [ ${#src[@]} -eq 0 ]; then
            echo "no $FBG here: the FBGEMM variants skip (run ../shared/device/fbgemm_cuda.sh, carry .fbg)"
        else
            [ -x "$z" ] || chmod +x "$z" 2>/dev/null
            if cat "${src[@]}" | "$z" -dc --long=27 | tar xf - -C /tmp/site; then
                touch /tmp/site/.fbgemm_cuda
            else
                echo "could not unpack ${src[*]}: the FBGEMM variants skip"
                status=1
            fi
        fi
    fi
    if [ -e /tmp/site/.fbgemm_cuda ]; then
        export CUDA_MODULE_LOADING=LAZY
        fbgemm=1
        export PYTHONPATH=/tmp/site:$PYTHONPATH
    fi
    for w in .whl/*.whl; do  # fbgemm-gpu-cpu would replace the CUDA build's fbgemm_gpu
        [ -e "$w" ] || continue
        [ "$fbgemm" = 1 ] && [[ $(basename "$w") == fbgemm_gpu_cpu-* ]] && continue
        wheels+=("$w")
    done
    if [ ${#wheels[@]} -eq 0 ]; then
        echo "no .whl/ here: TorchRec tests skip (run ../shared/device/wheels.sh, carry .whl)"
        return
    fi
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "${wheels[@]}" && export PYTHONPATH=/tmp/site:$PYTHONPATH
}

environment() {
    [ -n "$CHECK" ] && return
    {
        date
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
        free -g || true
        nproc
        $PY -c "import sys, torch; print(sys.version); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
        $PY -c "import fbgemm_gpu as f; print('fbgemm_gpu', f.__version__, f.__variant__)" 2>&1 | tail -1
        $PY -c "import torchrec, fbgemm_gpu; print('torchrec', torchrec.__version__)" 2>&1 | tail -1
    } 2>&1 | tee "$OUT/environment.txt"
}

stage_tests() {
    install_packages
    environment
    export DISTCACHE_SYNC_REPORT=$OUT/host_syncs.json  # written by test_overlap_cuda.py
    gpu_tests pytest_gpu 420
    step headline_smoke 120 $PY benchmarks/gpu_headline.py --device cuda --scale 100 \
        --steps 10 --max-warmup 300 --json "$OUT/gpu_headline_smoke.json"
}

stage_fbgemm() {
    install_packages
    environment
    local variants=fbgemm_device,distcache,fbgemm_uvm,fbgemm_uvm_prefetch
    step fbgemm_smoke 90 $PY benchmarks/gpu_headline.py --device cuda --scale 100 \
        --variants $variants --steps 10 --warmup 2 --max-warmup 300 --profile-steps 0 \
        --json "$OUT/gpu_headline_fbgemm_smoke.json"
    for opt in sgd rowwise_adagrad; do
        step "fbgemm_$opt" 240 $PY benchmarks/gpu_headline.py --device cuda --batch 4096 \
            --optimizer $opt --variants $variants --capacities "${FBGEMM_CAPACITIES:-0.02}" \
            --max-warmup 2000 --warmup 20 --steps 200 --profile-steps 2 \
            --json "$OUT/gpu_headline_fbgemm_$opt.json"
    done
}

stage_headline() {
    install_packages
    environment
    step headline_terabyte 360 $PY benchmarks/gpu_headline.py --device cuda \
        --capacities 0.02 --lru-capacities 0.02 --json "$OUT/gpu_headline_terabyte.json"
    step headline_terabyte_1pct 200 $PY benchmarks/gpu_headline.py --device cuda \
        --variants fbgemm_device,distcache,fbgemm_uvm,fbgemm_uvm_prefetch --capacities 0.01 \
        --json "$OUT/gpu_headline_terabyte_1pct.json"
}

stage_kaggle() {
    install_packages
    environment
    step throughput_cuda 180 $PY benchmarks/throughput.py --device cuda --ranks 1 --scale 1 \
        --capacities 1.0,0.05,0.02,0.01 --lru-capacities 0.05,0.02 --warmup 10 --steps 30 \
        --threads 8 --timeout 170 --json "$OUT/throughput_cuda_kaggle.json"
    step headline_kaggle 400 $PY benchmarks/gpu_headline.py --device cuda --tables kaggle \
        --dim 16 --capacities 1.0,0.05,0.02,0.01 --lru-capacities 0.05,0.02 --max-warmup 400 \
        --json "$OUT/gpu_headline_kaggle.json"
}

stage_direct() {
    environment
    step direct_terabyte 330 $PY benchmarks/gpu_headline.py --device cuda \
        --variants distcache,distcache_worker --capacities 0.02 --max-warmup 2000 \
        --json "$OUT/gpu_headline_terabyte_direct.json"
    step direct_kaggle 200 $PY benchmarks/gpu_headline.py --device cuda --tables kaggle \
        --dim 16 --variants distcache,distcache_worker --capacities 0.05,0.02 --max-warmup 400 \
        --json "$OUT/gpu_headline_kaggle_direct.json"
}

stage_engine() {
    environment
    step engine_cuda 420 $PY benchmarks/engine_throughput.py --device cuda --skip bytes \
        --rounds 3 --json "$OUT/engine_throughput_cuda.json"
}

stage_quick() {
    DEADLINE=$(($(date +%s) + ${QUICK_SECONDS:-420}))
    install_packages
    environment
    export DISTCACHE_SYNC_REPORT=$OUT/host_syncs.json
    # The sync and run-ahead checks first (pytest would run the files in name order), each
    # test's outcome as it ends (-v), so that a run cut by its limit still shows them.
    gpu_tests pytest_gpu 150 --ignore=tests/gpu/test_calibrate_cuda.py
    local rest=cpu_embeddings,distcache_worker,distcache_eager
    step headline_quick 270 $PY benchmarks/gpu_headline.py --device "${QUICK_DEVICE:-cuda}" \
        --scale "${QUICK_SCALE:-1}" --batch 4096 --capacities 0.02 --lru-capacities 0.02 \
        --variants "fbgemm_device,distcache,fbgemm_uvm,fbgemm_uvm_prefetch,lru,device,$rest" \
        --max-warmup 2000 --warmup 20 --steps 200 --profile-steps 2 \
        --json "$OUT/gpu_headline_quick.json"
    step engine_quick 120 $PY benchmarks/engine_throughput.py --device "${QUICK_DEVICE:-cuda}" \
        --skip scheduler,bytes --rounds 3 --json "$OUT/engine_throughput_quick.json" \
        ${QUICK_ENGINE_ARGS:-}
    # The GPU as the planner's topology (what tests/gpu/test_calibrate_cuda.py checks): then,
    # on the development machine, benchmarks/planner_vs_gpu.py HEADLINE_JSON --topology
    # calibrated_gpu.json, and its figures, machine and date into the h100/h200 presets.
    step calibrate_quick 90 $PY -m distcache calibrate --device "${QUICK_DEVICE:-cuda}" \
        --ranks 1 --quick --timeout 80 --out "$OUT/calibrated_gpu.json"
}

pack_out() {  # at most 8 files come back from the device tool: one archive of them all
    [ -n "$CHECK" ] && return
    (cd "$OUT" && tar czf "../$(basename "$OUT").tgz" . && rm -rf ./* && mv "../$(basename "$OUT").tgz" all.tgz)
}

# Issue 33 (ahead of FBGEMM's UVM cache) in two calls of one 15-minute session, each within a
# budget of its own (ISSUE33_SECONDS), in order of importance, outputs packed into all.tgz:
#     run(command="bash benchmarks/gpu_session.sh issue33a", carry=[".fbg", ".whl"], timeout_s=570)
#     run(command="bash benchmarks/gpu_session.sh issue33b", carry=[".fbg", ".whl"], timeout_s=330)
stage_issue33() {  # what fits one call when about 5 minutes of device time are left
    DEADLINE=$(($(date +%s) + ${ISSUE33_SECONDS:-245}))
    install_packages
    environment
    step terabyte_2pct 190 $PY benchmarks/gpu_headline.py --device cuda --batch 4096 \
        --variants fbgemm_device,distcache,fbgemm_uvm,fbgemm_uvm_prefetch,distcache_torch \
        --capacities 0.02 --max-warmup 1500 --warmup 10 --steps 100 --profile-steps 1 \
        --json "$OUT/headline_terabyte_2pct.json"
    step engine_capacity 45 $PY benchmarks/engine_throughput.py --device cuda \
        --skip scheduler,fwd,bytes,ops,host --cap-fractions 0.01,0.02,0.05,0.1 \
        --rounds 3 --sched-steps 4 --sched-warmup 4 --json "$OUT/engine_capacity_cuda.json"
    pack_out
}

stage_issue33a() {
    DEADLINE=$(($(date +%s) + ${ISSUE33_SECONDS:-530}))
    install_packages
    environment
    local v=fbgemm_device,distcache,fbgemm_uvm,fbgemm_uvm_prefetch
    # (no smoke run first: these commands have run at full size, 2026-11-26 and -27)
    step terabyte_2pct 170 $PY benchmarks/gpu_headline.py --device cuda --batch 4096 \
        --variants $v,distcache_torch --capacities 0.02 --max-warmup 2000 --warmup 20 \
        --steps 200 --profile-steps 2 --json "$OUT/headline_terabyte_2pct.json"
    # (one step per fraction: at 2026-11-27 both in one 200 s step left out the last variant;
    # each FBGEMM UVM variant takes about 36 s to build at this size)
    for pct in 5 1; do
        step terabyte_${pct}pct 150 $PY benchmarks/gpu_headline.py --device cuda --batch 4096 \
            --variants $v --capacities "0.0$pct" --max-warmup 2000 --warmup 20 \
            --steps 200 --profile-steps 2 --json "$OUT/headline_terabyte_${pct}pct.json"
    done
    # Issue 33's check (within 15 % across 1, 5 and 20 %); 3 rounds spread 0.85-1.41 ms on an
    # H200, so 7 of 16 batches each.
    step engine_capacity 60 $PY benchmarks/engine_throughput.py --device cuda \
        --skip scheduler,fwd,bytes,ops,host --cap-fractions 0.01,0.05,0.2 --rounds 7 \
        --sched-steps 16 --json "$OUT/engine_capacity_cuda.json"
    pack_out
}

# After `host`, if distcache_fused shortened the step there: the same at Criteo Terabyte's full
# size, 2 % (distcache with and without its fused passes, beside FBGEMM with every row in HBM
# and its UVM cache), then the scheduler alone at 1, 5 and 20 % with and without them:
#     run(command="bash benchmarks/gpu_session.sh fused", carry=[".fbg"], timeout_s=330)
# (after `host` in one session: FUSED_SECONDS=200 and timeout_s=230, the headline step alone)
stage_fused() {
    DEADLINE=$(($(date +%s) + ${FUSED_SECONDS:-300}))
    install_packages
    environment
    step terabyte_fused 170 $PY benchmarks/gpu_headline.py --device cuda --batch 4096 \
        --variants fbgemm_device,distcache,distcache_fused,fbgemm_uvm --capacities 0.02 \
        --max-warmup 2000 --warmup 20 --steps 200 --profile-steps 2 \
        --json "$OUT/headline_terabyte_fused.json"
    for fused in "" --fused; do
        step "engine_capacity${fused:+_fused}" 55 $PY benchmarks/engine_throughput.py \
            --device cuda --skip scheduler,fwd,bytes,ops,host --cap-fractions 0.01,0.05,0.2 \
            --rounds 5 --sched-steps 16 $fused \
            --json "$OUT/engine_capacity_cuda${fused:+_fused}.json"
    done
    pack_out
}

stage_issue33b() {
    DEADLINE=$(($(date +%s) + ${ISSUE33_SECONDS:-300}))
    install_packages
    local v=fbgemm_device,distcache,fbgemm_uvm,fbgemm_uvm_prefetch
    export DISTCACHE_SYNC_REPORT=$OUT/host_syncs.json
    gpu_tests pytest_gpu 130
    step terabyte_adagrad 110 $PY benchmarks/gpu_headline.py --device cuda --batch 4096 \
        --optimizer rowwise_adagrad --variants $v --capacities 0.02 --max-warmup 2000 \
        --warmup 20 --steps 100 --profile-steps 0 --json "$OUT/headline_terabyte_adagrad.json"
    step kaggle 60 $PY benchmarks/gpu_headline.py --device cuda --tables kaggle --dim 16 \
        --variants $v --capacities 0.05,0.02 --max-warmup 600 --warmup 20 --steps 100 \
        --profile-steps 0 --json "$OUT/headline_kaggle.json"
    pack_out
}

# Issue 33, after the H200 session of 2026-11-27 (distcache's step was 4.2 ms at every cache size
# and table set, FBGEMM's every-row-in-HBM step 2.7 ms: the host's work per step?): the CUDA
# tests first (5 of 86 failed there; fixed since, unverified), then where the host's time goes,
# at 1/100 of Criteo Terabyte's rows (the same ids per step): each phase's host ms per step for
# FBGEMM with every row in HBM, its UVM cache and distcache (host-bound if they sum to the step;
# else the device: without graphs, the profile names the scheduler's kernels and their device
# time), then distcache against the same with its scheduler's fused passes (`fused=True`, which
# shortens the enqueue graph from about 40 kernels to 5: if the step shortens, the device's
# work bounds it), the GPU's calibration for the planner (--quick), then distcache's timed steps
# under cProfile (the functions of most host time), each step cut to the budget left:
#     run(command="bash benchmarks/gpu_session.sh host", carry=[".fbg", ".whl"], timeout_s=590)
# (tests/gpu's limit allows for Triton compiling the fused kernels: about 20 of them.)
stage_host() {
    DEADLINE=$(($(date +%s) + ${HOST_SECONDS:-560}))
    install_packages
    environment
    export DISTCACHE_SYNC_REPORT=$OUT/host_syncs.json
    gpu_tests pytest_gpu 240
    # (distcache_eager: the scheduler's kernels one by one, named in the profile's device time;
    # 100 %: a cache of every row, which chooses no victims and moves no row)
    step host_phases 150 $PY benchmarks/gpu_headline.py --device cuda --scale 100 --batch 4096 \
        --variants fbgemm_device,distcache,fbgemm_uvm,distcache_eager --capacities 0.02,1.0 \
        --max-warmup 800 --warmup 20 --steps 200 --profile-steps 2 \
        --json "$OUT/headline_host_phases.json"
    step host_fused 70 $PY benchmarks/gpu_headline.py --device cuda --scale 100 --batch 4096 \
        --variants fbgemm_device,distcache,distcache_fused --capacities 0.02 --max-warmup 800 \
        --warmup 20 --steps 200 --profile-steps 2 --json "$OUT/headline_host_fused.json"
    # The GPU as the planner's topology (issue 35, item 1), before the profile: planner_vs_gpu.py
    # prices the committed headline runs with it here afterwards.
    step calibrate_quick 90 $PY -m distcache calibrate --device cuda --ranks 1 --quick \
        --timeout 80 --out "$OUT/calibrated_gpu_quick.json"
    step host_cprofile 60 $PY benchmarks/gpu_headline.py --device cuda --scale 100 --batch 4096 \
        --variants distcache --capacities 0.02 --max-warmup 800 --warmup 20 --steps 200 \
        --profile-steps 0 --cprofile 60 --json "$OUT/headline_host_cprofile.json"
    pack_out
}

# Issue 36: what a TorchRec user runs, on one GPU: DMP + LookaheadTrainPipeline against TorchRec's
# fused (every row in HBM) and fused_uvm_caching under TrainPipelineSparseDist and
# PrefetchTrainPipelineSparseDist, at Criteo Terabyte's sizes (dim 16: 12 GB of rows per variant
# in host memory) and Kaggle's, each step's host time by phase (--phases: the pipelines' stages and
# distcache's engine calls, against TorchRec's); then the training job's GPU test (resume, bitwise):
#     run(command="bash benchmarks/gpu_session.sh issue36", carry=[".fbg", ".whl"], timeout_s=570)
stage_issue36() {
    DEADLINE=$(($(date +%s) + ${ISSUE36_SECONDS:-530}))
    install_packages
    environment
    # (2026-11-28 on an H200 neither finished building its variants within 240 s and 116 s:
    # the models are built from one now, each step prints what it built and when, and the
    # Kaggle run comes first, with fewer variants)
    throughput_kaggle
    step throughput_terabyte 300 $PY benchmarks/throughput.py --device cuda --ranks 1 \
        --tables terabyte --scale 1 --batch 4096 --capacities 0.02 --uvm-capacities 0.02 \
        --lru-capacities "" --no-cpu-embeddings --warmup 20 --steps 50 --threads 8 \
        --timeout 290 --phases --json "$OUT/throughput_cuda_terabyte.json"
    step job_gpu 150 $PY -m pytest tests/gpu/test_job_cuda.py -q -p no:cacheprovider -rs
    pack_out
}

# Issue 33, item 4: does direct staging's copy take SMs from training? distcache at 2 % beside
# FBGEMM's TBE with every row in HBM, its copy limited to 4, 16 (the default) and 128 thread
# blocks; compare the dense part's device time in each JSON's profile:
#     run(command="bash benchmarks/gpu_session.sh staging", carry=[".fbg"], timeout_s=420)
stage_staging() {
    DEADLINE=$(($(date +%s) + ${STAGING_SECONDS:-380}))
    install_packages
    environment
    for programs in 4 16 128; do
        step staging_$programs 120 $PY benchmarks/gpu_headline.py --device cuda --batch 4096 \
            --scale 4 --variants fbgemm_device,distcache --capacities 0.02 \
            --staging-programs $programs --max-warmup 1500 --warmup 20 --steps 100 \
            --profile-steps 3 --json "$OUT/headline_staging_$programs.json"
    done
    pack_out
}

# Issue 35, item 2: plans compared by running them on one GPU, in one process. `compare
# --measure --device cuda` runs TorchRec's planner's plan on TorchRec's own kernels as it chose
# them for 16 GB of device memory (fused where rows fit, fused_uvm_caching where they do not:
# LRU, host-mapped, TrainPipelineSparseDist) beside distcache's plan (its sharder and
# LookaheadTrainPipeline), on Criteo Terabyte's 26 tables at dim 64 (48 GB of fp32 rows per
# plan in host memory: the two plans take about 97 GB of the 128 GiB), and prints measured
# and modelled steps together (the table in compare_terabyte.log, the JSON beside it). Check:
# both plans measured, distcache's >= 1.2 x TorchRec's, and the model ranks them alike.
#     run(command="bash benchmarks/gpu_session.sh issue35", carry=[".fbg", ".whl"], timeout_s=570)
# Budget (ISSUE35_SECONDS, default 530 s; a step's limit is cut to what is left): the path's GPU
# tests (small tables, a few steps) 120 s, then the comparison 400 s (most of it building two
# models of 188 M rows; 500 warm-up and 200 timed steps per plan take well under a minute).
stage_issue35() {
    DEADLINE=$(($(date +%s) + ${ISSUE35_SECONDS:-530}))
    install_packages
    environment
    step measure_cuda_tests 120 $PY -m pytest tests/gpu/test_measure_cuda.py -v \
        -p no:cacheprovider -rs
    step compare_terabyte 400 $PY -m distcache compare \
        --config configs/criteo_terabyte_synthetic.toml --topology h100 --world-size 1 \
        --device-memory 16GB --measure --device cuda --measure-warmup 500 --measure-steps 200 \
        --json-out "$OUT/compare_terabyte_cuda.json"
    pack_out
}

# Issue 35, item 1: the GPU's figures for the cost model. `distcache calibrate --device cuda`
# (the lookups and the scheduler timed as the device's work, `distcache/tools/devicetime.py`),
# quick then full sizes, each topology in $OUT; then, here on CPU, `planner_vs_gpu.py` prices
# the committed headline runs with it (the check: every variant's step within +-25 %):
#     run(command="bash benchmarks/gpu_session.sh calibrate", carry=[".fbg", ".whl"], timeout_s=330)
stage_calibrate() {
    DEADLINE=$(($(date +%s) + ${CALIBRATE_SECONDS:-300}))
    install_packages
    environment
    step calibrate_quick 100 $PY -m distcache calibrate --device cuda --ranks 1 --quick \
        --out "$OUT/calibrated_gpu_quick.json"
    step calibrate_full 190 $PY -m distcache calibrate --device cuda --ranks 1 \
        --out "$OUT/calibrated_gpu.json"
    pack_out
}

# After 2026-11-28 (the H200 cut the CUDA tests at 66 of 104, the quick calibration at 90 s
# and both throughput.py runs while building), the checks of what was fixed, in one call
# after `unpack` (below): the CUDA tests, the sync and run-ahead ones first; the GPU's
# calibration for the planner (saying what it measured as it goes); throughput.py at
# Kaggle's size (DMP, LookaheadTrainPipeline against fused and fused_uvm_caching). Since
# 2026-11-28 (fourth session) the second call after `unpack`, `hostcheck` (below) the first;
# give it the time left:
#     run(command="VERIFY_SECONDS=<left - 30> bash benchmarks/gpu_session.sh verify",
#         carry=[".fbg2", ".whl"], timeout_s=<left>)
stage_verify() {
    DEADLINE=$(($(date +%s) + ${VERIFY_SECONDS:-560}))
    install_packages
    environment
    export DISTCACHE_SYNC_REPORT=$OUT/host_syncs.json
    gpu_tests pytest_gpu 260 --ignore=tests/gpu/test_calibrate_cuda.py
    step calibrate_quick 120 $PY -m distcache calibrate --device cuda --ranks 1 --quick \
        --timeout 110 --out "$OUT/calibrated_gpu_quick.json"
    throughput_kaggle
    pack_out
}

# The host-path check, the next GPU session's first call after `unpack` (then `verify` with the
# time left, VERIFY_SECONDS=...): what the host-path changes after 2026-11-28 bought (stream
# calls by device index, a85b3f5; graph inputs and results packed per dtype, ad08b0e), and the
# scheduler's calls on a thread of their own (`CacheConfig.scheduler_thread`, gpu_headline's
# distcache_thread): distcache at 2 % of 1/100 of Terabyte's rows beside FBGEMM with every row
# in HBM, run by the code the H200 measured that day (08a03dc) and by this tree (with and
# without the thread, in one process), in turns, in one call; between the turns
# `host_overlap.py`: the training step alone and beside distcache's scheduling inline, on a
# thread and in a process of its own (what moving that host work off the training thread can
# buy at all, on a GPU whose contexts are time-sliced). Pack that code here first
# (/.base/ is in .git/info/exclude; 0.3 MB):
#     mkdir -p .base && git archive -o .base/base.tar.gz 08a03dc distcache \
#         $(git ls-tree --name-only 08a03dc benchmarks/ | grep '\.py$')
#     run(command="bash benchmarks/gpu_session.sh hostcheck", carry=[".fbg2", ".base"], timeout_s=310)
# (Its gpu_headline.py puts its own tree first on the path; its flags are those below, checked
# here with tests/argv_check.py when it was packed, not by the test of this script.) This tree's
# first run also profiles as many steps again under cProfile, after the timed ones: where the
# host's time goes once those changes are in, without slowing the steps that are timed.
stage_hostcheck() {
    DEADLINE=$(($(date +%s) + ${HOSTCHECK_SECONDS:-290}))
    install_packages
    local args=(--device cuda --scale 100 --batch 4096 --capacities 0.02 --max-warmup 800
        --warmup 20 --steps 200 --profile-steps 0)
    local base=""
    if [ -f .base/base.tar.gz ] && [ -z "$CHECK" ]; then
        mkdir -p /tmp/base && tar -xzf .base/base.tar.gz -C /tmp/base && base=/tmp/base
    fi
    local profiled=(--cprofile 40)
    for turn in 1 2; do
        [ -n "$base" ] && step "host_base_$turn" 40 $PY "$base/benchmarks/gpu_headline.py" \
            "${args[@]}" --variants fbgemm_device,distcache --json "$OUT/headline_host_base_$turn.json"
        step "host_head_$turn" 60 $PY benchmarks/gpu_headline.py "${args[@]}" "${profiled[@]}" \
            --variants fbgemm_device,distcache,distcache_thread \
            --json "$OUT/headline_host_head_$turn.json"
        profiled=()
        # Between the turns: whether the scheduling's host work can leave the training thread
        # at all, on a thread or in a process of its own (its own CUDA context), against the
        # step alone and with it inline.
        [ "$turn" = 1 ] && step host_overlap 90 $PY benchmarks/host_overlap.py --device cuda \
            --json "$OUT/host_overlap.json"
    done
    pack_out
}

# When the tree, .fbg and .whl together pass the 64 MiB a call may carry: split .fbg in two here,
#     mkdir -p .fbg1 .fbg2 && split -n 2 -d "$FBG" .fbg/x && mv .fbg/x00 .fbg/zstd .fbg1/ \
#         && mv .fbg/x01 .fbg2/    (both folders in .git/info/exclude)
# then a first short call leaves the first half in /tmp/fbgparts, which stays while the machine
# is warm (30 s idle), and the next call carries the second half beside .whl:
#     run(command="bash benchmarks/gpu_session.sh unpack", carry=[".fbg1"], timeout_s=60)
#     run(command="bash benchmarks/gpu_session.sh host", carry=[".fbg2", ".whl"], timeout_s=590)
stage_unpack() {  # no step: nothing for the check mode to record
    [ -n "$CHECK" ] && return
    mkdir -p /tmp/fbgparts && cp .fbg1/x00 .fbg1/zstd /tmp/fbgparts/ || exit 1
    echo "the first half of FBGEMM's pack is in /tmp/fbgparts"
}

case "${1:-}" in
    unpack) stage_unpack ;;
    verify) stage_verify ;;
    hostcheck) stage_hostcheck ;;
    quick) stage_quick ;;
    calibrate) stage_calibrate ;;
    issue35) stage_issue35 ;;
    staging) stage_staging ;;
    issue36) stage_issue36 ;;
    fbgemm) stage_fbgemm ;;
    issue33) stage_issue33 ;;
    issue33a) stage_issue33a ;;
    issue33b) stage_issue33b ;;
    host) stage_host ;;
    fused) stage_fused ;;
    tests) stage_tests ;;
    engine) stage_engine ;;
    direct) stage_direct ;;
    headline) stage_headline ;;
    kaggle) stage_kaggle ;;
    *)
        echo "usage: $0 unpack|verify|hostcheck|quick|calibrate|issue35|staging|issue36|fbgemm|issue33|issue33a|issue33b|host|fused|tests|headline|kaggle|direct|engine (see the top of this file)" >&2
        exit 2
        ;;
esac
echo "== done ($(date +%T)), status $status; outputs in $OUT"
exit $status
