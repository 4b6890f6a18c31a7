#!/usr/bin/env bash
# Two NCCL ranks on one GPU (bench/shared_gpu.py): FSDP2's NCCL path at world size 2, in at most 6 minutes, on an
# offline GPU machine as it is.
#
#   bash bench/gpu_wheels.sh                      # first, where a registry is reachable: the wheels into .whl/
#   bash bench/gpu_two_ranks.sh OUT               # on the GPU machine: every stage, in order; OUT/summary.md
#   bash bench/gpu_two_ranks.sh --dry-run OUT     # print the stages, their limits and commands; run nothing
#   bash bench/gpu_two_ranks.sh --rehearse OUT    # here, no GPU: every stage on CPU with gloo (see below)
#
# What it measures: whether each stage of the project runs with two NCCL ranks sharing one GPU, and the figures
# those stages print. The two ranks time-slice one GPU and talk over NCCL's own transport to itself, so the step
# times and the verdict are not a cluster's; the collectives are real NCCL kernels on FSDP2's streams, and their
# times are the kernels' own on NCCL's stream, read from a Kineto trace of two recorded steps (runtime/recording/
# collective_trace.py; the rehearsal keeps the CPU's isolated figures).
#
# For the GPU machines' own Python 3.12 and torch 2.11 (NCCL 2.28.9: per-rank NCCL_HOSTID; NCCL 2.30+:
# NCCL_MULTI_RANK_GPU_ENABLE). The project goes on PYTHONPATH, not installed; the wheels in .whl/ install first into
# a folder of their own, without an index. Each stage has its own limit, the whole run GPU_TWO_RANKS_BUDGET seconds
# (default 360), so a rerun fits in 15 minutes of GPU time; a stage past its limit gets SIGTERM, then SIGKILL 40 s
# later. Before each stage, any process still holding the GPU is reported (nvidia-smi), and ranks of an earlier
# stage are killed. Stages, in order:
#   env        the carried wheels installed, everything later stages import imported; torch, CUDA, NCCL, the route
#              NCCL takes to two ranks on one GPU, the knobs this torch lacks (bench/gpu_env.py). On any failure the
#              run stops here, within 20 s, with one line naming what is missing.
#   profile    the recorder's profile on 2 NCCL ranks (per-module all-gather and reduce-scatter times and bytes)
#   tune       prefetch-planner tune on bench/llama-gpu-two-ranks.toml (race and confirmation on the shared GPU)
#   in-loop    the in-loop tuner on docs/examples/plain_loop.py --quick
#   watch-cost what the in-loop watch costs a step: N watched steps against N plain steps of the same plan,
#              interleaved, their wall-time ratio (bench.watch_cost; two ranks on one GPU test the mechanism, not the
#              speed)
#   trace      the trace profile from a 2-rank Kineto trace, checked against the recorder (bench.trace_profile)
#   peak       world-size-2 peaks, predicted against measured (bench.peak_memory)
#   hf         transformers.Trainer.train() on a Llama transformers shards with FSDP2 (hf_trainer.py --small), where
#              accelerate is 1.16 or later
#   torchtitan the recipe, where torchtitan imports (its dependencies do not fit the 64 MiB a run carries)
# Then OUT/summary.md and OUT/summary.json (bench/gpu_summary.py): the profile's per-module collectives, the tune
# verdict and ratio, FSDP2's default step and peak predicted against measured, how the in-loop tuner ended, the
# watch's cost, and each stage's time. The script exits 0 when every stage that ran passed, 1 when one failed, 2 when the env stage did.
#
# --rehearse runs every stage on this machine's CPU with gloo, on bench/llama-two-ranks-rehearsal.toml (the same
# Llama, smaller), in a fresh virtual environment (GPU_REHEARSAL_VENV, default /tmp/gpu-rehearsal-venv) that holds
# the GPU image's Python packages as closely as this machine allows, plus the carried wheels, and nothing else. Where
# it differs from the image ('cuda', as read on 2026-11-17):
#   Python 3.12.1 (the image: 3.12.3); torch 2.11.0 from PyPI, its CUDA 13 build run on the CPU (the image:
#   2.11.0+cu130 on the GPU); numpy 2.5.2 as there; scipy and numba as pip resolves them (the image's scipy and
#   numba versions are not recorded); accelerate 1.15.0, transformers 5.17.0, tokenizers 0.23.2 and safetensors
#   0.8.0 as there. Its limits are the GPU's times GPU_REHEARSAL_SCALE (default 5): two CPU cores run what a GPU runs.
set -u
mode=gpu
case "${1:-}" in
    --dry-run) mode=dry; shift ;;
    --rehearse) mode=rehearse; shift ;;
esac
out=${1:?usage: bash bench/gpu_two_ranks.sh [--dry-run|--rehearse] OUT}
mkdir -p "$out/stages"
out=$(cd "$out" && pwd)
log=$out/gpu-two-ranks.log
: >"$out/stages.tsv"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=1
work=${TMPDIR:-/tmp}/gpu-two-ranks  # the installed wheels and the traces: not brought back with OUT
site=$work/site
[ $mode = dry ] || rm -rf "$work/traces"  # an earlier run's traces would hold the same steps again
study=bench/llama-gpu-two-ranks.toml
watch_study=bench/llama-gpu-watch-cost.toml  # a smaller model: the watch's mechanism, 160 short steps
scale=1
py=python3
if [ $mode = rehearse ]; then
    study=bench/llama-two-ranks-rehearsal.toml
    watch_study=$study
    scale=${GPU_REHEARSAL_SCALE:-5}
    venv=${GPU_REHEARSAL_VENV:-/tmp/gpu-rehearsal-venv}
    bash bench/gpu_rehearsal_venv.sh "$venv" || exit 2
    py=$venv/bin/python3
    export PATH=$venv/bin:$PATH
fi
budget=$(( ${GPU_TWO_RANKS_BUDGET:-360} * scale ))
two=("$py" -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.shared_gpu)
python3 -c "import tomllib; print(tomllib.load(open('$study', 'rb'))['study']['name'])" >"$out/study-name"

holders() {  # processes holding the GPU (or, without one, ranks of an earlier stage); killed if ours
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader 2>/dev/null
    fi
    pgrep -af "bench.shared_gpu" | grep -v pgrep
}

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit; its output in the log and stages/NAME.log
    local name=$1 limit=$(( $2 * scale ))
    shift 2
    local left=$((budget - SECONDS - 5))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ $mode = dry ]; then echo "stage $name $limit $*"; return 0; fi
    if [ "$limit" -lt 10 ]; then echo "=== $name: skipped, the budget is spent" | tee -a "$log"; return 0; fi
    local held
    held=$(holders)
    if [ -n "$held" ]; then
        echo "=== before $name: still holding the GPU or running: $(echo "$held" | tr '\n' ';')" | tee -a "$log"
        pkill -9 -f "bench.shared_gpu" 2>/dev/null
        sleep 2
    fi
    echo "=== $name: $* (limit ${limit}s)" | tee -a "$log"
    local t0=$SECONDS
    timeout -k 40 "$limit" "$@" 2>&1 | tee "$out/stages/$name.log" >>"$log"
    local status=${PIPESTATUS[0]}
    tail -3 "$out/stages/$name.log"
    echo "=== $name: exit $status after $((SECONDS - t0))s" | tee -a "$log"
    printf '%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" "$limit" >>"$out/stages.tsv"
    return "$status"
}

if [ $mode = dry ]; then
    stage env 20 "$py" -m bench.gpu_env --wheels .whl --site "$site"
else
    { echo "machine: $(nvidia-smi -L 2>/dev/null | head -1 || true) $(uname -n); mode $mode; $(date -u)"; } \
        | tee -a "$log" | sed 's/^machine: //' >"$out/machine.txt"
    if ! stage env 20 "$py" -m bench.gpu_env --wheels .whl --site "$site"; then
        echo "=== stopped: the env stage failed; nothing else ran" | tee -a "$log"
        exit 2
    fi
fi
export PYTHONPATH=$site:$PWD
device_flags=()
[ $mode = rehearse ] && device_flags=(--cpu)
stage profile 50 "${two[@]}" jobs.cli profile $study -o "$out/profile.json"
stage tune 100 "${two[@]}" jobs.cli tune $study --storage "sqlite:///$out/two-ranks.db" --plan-out "$out/plan.json" \
    --profile-out "$out/tune-profile.json" --no-progress
stage in-loop 40 "${two[@]}" docs/examples/plain_loop.py --quick --steps 60 --storage "sqlite:///$out/plain-loop.db"
stage watch-cost 25 "${two[@]}" bench.watch_cost $watch_study --stretches 4 --steps 16 --json "$out/watch-cost.json"
stage trace 35 "${two[@]}" bench.trace_profile $study --steps 3 --json "$out/trace-profile.json" \
    --traces "$work/traces"
stage peak 35 "${two[@]}" bench.peak_memory $study --json "$out/peak-memory.json"
# Accelerate before 1.16 (the image's 1.15, with transformers 5.17) puts the model transformers sharded under DDP
# (Accelerator.prepare_model), which refuses DTensor parameters on GPUs and fails on them on CPU under torch 2.11:
# the stage would spend its time on a known failure. The suite's Hugging Face test passes with 1.16 and 5.25.
if [ $mode = dry ] || "$py" -c 'import sys, accelerate, transformers
sys.exit(tuple(map(int, accelerate.__version__.split(".")[:2])) < (1, 16))' 2>/dev/null; then
    stage hf 40 "${two[@]}" docs/examples/hf_trainer.py --small --quick "${device_flags[@]}" \
        --storage "sqlite:///$out/hf.db"
else
    echo "=== hf: skipped: accelerate $("$py" -c 'import accelerate; print(accelerate.__version__)' 2>/dev/null ||
        echo 'missing') here; the example needs 1.16 or later (older ones wrap the sharded model in DDP)" \
        | tee -a "$log"
fi
if [ $mode = dry ] || "$py" -c 'import torchtitan' 2>/dev/null; then
    stage torchtitan 15 "${two[@]}" docs/examples/torchtitan_recipe.py --debug-model --quick --steps 20 \
        --storage "sqlite:///$out/torchtitan.db"
else
    echo "=== torchtitan: skipped: torchtitan is not installed here, and its dependencies do not fit the 64 MiB" \
        "a run carries" | tee -a "$log"
fi
[ $mode = dry ] && exit 0
"$py" -m bench.gpu_summary "$out" >/dev/null && echo "=== summary: $out/summary.md" | tee -a "$log"
failed=$(awk -F'\t' '$2 != 0 {print $1}' "$out/stages.tsv" | tr '\n' ' ')
echo "=== done in ${SECONDS}s; ${failed:+failed: $failed}" | tee -a "$log"
[ -z "$failed" ]
