#!/usr/bin/env bash
# Two NCCL ranks on one GPU (bench/shared_gpu.py): the NCCL path of FSDP2 at world size 2, in at most 6 minutes.
#
#   bash bench/gpu_two_ranks.sh OUT            # every stage, in this order
#   bash bench/gpu_two_ranks.sh --dry-run OUT  # print the stages, their limits and commands; run nothing
#
# For the GPU machines' own torch (2.11, NCCL 2.28.9: per-rank NCCL_HOSTID; NCCL 2.30+: NCCL_MULTI_RANK_GPU_ENABLE).
# Runs from the repository root; the project goes on PYTHONPATH, wheels in .whl/ (if any: accelerate, for the hf
# stage; `pip download --no-deps accelerate -d .whl` where a registry is reachable) are installed first, without
# an index. Each stage has its own time limit and the whole run GPU_TWO_RANKS_BUDGET seconds (default 360), so a
# rerun fits in 15 minutes of GPU time. Stages, in order:
#   env        torch, CUDA, NCCL, the route NCCL takes to two ranks on one GPU
#   profile    the recorder's profile with NCCL (CUDA events on FSDP2's all-gather and reduce-scatter streams)
#   tune       prefetch-planner tune on bench/llama-gpu-two-ranks.toml (race and confirmation on the shared GPU)
#   in-loop    the in-loop tuner on docs/examples/plain_loop.py --quick
#   trace      the trace profile from a 2-rank Kineto trace, checked against the recorder (bench.trace_profile)
#   peak       world-size-2 peaks, predicted against measured (bench.peak_memory)
#   hf         transformers.Trainer.train() on a Llama transformers shards with FSDP2 (hf_trainer.py --small)
#   torchtitan the recipe, where torchtitan imports: its wheel (1.3 MB) needs datasets (pyarrow), tensorboard,
#              wandb, tyro, torchdata and spmd_types, past the 64 MiB a run carries; so it runs only where installed
set -u
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out=${1:?usage: bash bench/gpu_two_ranks.sh [--dry-run] OUT}
budget=${GPU_TWO_RANKS_BUDGET:-360}
study=bench/llama-gpu-two-ranks.toml
mkdir -p "$out"
log=$out/gpu-two-ranks.log
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=1
if [ $dry = 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
two=(python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m bench.shared_gpu)

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log its output and how it ended
    local name=$1 limit=$2
    shift 2
    local left=$((budget - SECONDS - 5))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ $dry = 1 ]; then echo "stage $name $limit $*"; return; fi
    if [ "$limit" -lt 10 ]; then echo "=== $name: skipped, the budget is spent" | tee -a "$log"; return; fi
    echo "=== $name: $* (limit ${limit}s)" | tee -a "$log"
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0))s" | tee -a "$log"
}

stage env 20 python3 -c 'import torch
v = torch.cuda.nccl.version()
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "nccl", v,
      "route:", "NCCL_MULTI_RANK_GPU_ENABLE=1" if v >= (2, 30, 0) else "NCCL_HOSTID per rank, NCCL_SOCKET_IFNAME=lo")'
stage profile 50 "${two[@]}" jobs.cli profile $study -o "$out/profile.json"
stage tune 100 "${two[@]}" jobs.cli tune $study --storage "sqlite:///$out/two-ranks.db" --plan-out "$out/plan.json" \
    --profile-out "$out/tune-profile.json" --no-progress
stage in-loop 45 "${two[@]}" docs/examples/plain_loop.py --quick --steps 60 --storage "sqlite:///$out/plain-loop.db"
stage trace 45 "${two[@]}" bench.trace_profile $study --steps 3 --json "$out/trace-profile.json" \
    --traces /tmp/traces-two-ranks
stage peak 40 "${two[@]}" bench.peak_memory $study --json "$out/peak-memory.json"
if [ $dry = 1 ] || python3 -c 'import accelerate' 2>/dev/null; then
    stage hf 45 "${two[@]}" docs/examples/hf_trainer.py --small --quick --storage "sqlite:///$out/hf.db"
else
    echo "=== hf: skipped: accelerate is not installed here (put its wheel in .whl/)" | tee -a "$log"
fi
if [ $dry = 1 ] || python3 -c 'import torchtitan' 2>/dev/null; then
    stage torchtitan 15 "${two[@]}" docs/examples/torchtitan_recipe.py --debug-model --quick --steps 20 --storage "sqlite:///$out/torchtitan.db"
else
    echo "=== torchtitan: skipped: torchtitan is not installed here, and its dependencies do not fit the 64 MiB" \
        "a run carries" | tee -a "$log"
fi
[ $dry = 1 ] || echo "=== done in ${SECONDS}s" | tee -a "$log"
