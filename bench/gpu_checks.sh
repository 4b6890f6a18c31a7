#!/usr/bin/env bash
# The GPU checks of issue 21 on one CUDA machine, each stage bounded in time; results and one log under OUT.
#
#   bash bench/gpu_checks.sh OUT [STAGE ...]
#   # stages: env smoke trace fidelity peak ac ac-fidelity ac-selective qwen2 qwen2-trace tune (default: all but
#   # qwen2-trace, which qwen2 holds)
#
# Each study runs one rank per GPU of the machine (a copy of its TOML in /tmp/gpu-studies).
#
# GPU_CHECKS_BUDGET=SECONDS bounds the whole run: a stage gets at most what is left of it (its own limit else).
# Runs from the repository root with the machine's own torch (the project is put on PYTHONPATH, not installed;
# wheels in .whl/, if any, go first: a machine with no package index). What each stage runs:
#   smoke     bench.trace_profile on bench/llama-gpu-small.toml, 3 traced steps (a quick first pass of every
#             GPU path: CUDA events, the caching allocator's peak, CUDA traces)
#   trace     bench.trace_profile on studies/llama-gpu.toml, 5 traced steps
#   fidelity  bench.fidelity on studies/llama-gpu.toml, 7 rounds (the JSON is written before the minutes-long report)
#   peak      bench.peak_memory on studies/llama-gpu.toml
#   ac        bench.trace_profile on bench/llama-gpu-ac-full.toml (every block checkpointed)
#   ac-fidelity  bench.fidelity --measure-only on bench/llama-gpu-ac-selective.toml (every other block
#             checkpointed), then on bench/llama-gpu-ac-full.toml, 7 rounds each (the fits: --refit on the JSON)
#   ac-selective  bench.peak_memory, then bench.trace_profile (5 traced steps), on bench/llama-gpu-ac-selective.toml
#   qwen2     bench.peak_memory, then bench.trace_profile (3 traced steps), on bench/qwen2-gpu.toml (a model not tuned
#             on, with a 151936-word vocabulary: the largest backward temporaries)
#   qwen2-trace  its bench.trace_profile alone
#   tune      prefetch-planner tune studies/llama-gpu.toml, then studies best; the study's SQLite file and plan kept
set -u
out=${1:?usage: bash bench/gpu_checks.sh OUT [STAGE ...]}
shift
stages=${*:-env smoke trace fidelity peak ac ac-fidelity ac-selective qwen2 tune}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site:$PWD
fi
log=$out/gpu-checks.log
# The studies with one rank per GPU of this machine (world size 1 on one GPU: FSDP2 then runs no collective).
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
[ "$gpus" -ge 1 ] || gpus=1
st=/tmp/gpu-studies
mkdir -p $st
for f in studies/llama-gpu.toml bench/llama-gpu-small.toml bench/llama-gpu-ac-full.toml bench/llama-gpu-ac-selective.toml \
    bench/qwen2-gpu.toml; do
    sed "s/^nproc_per_node = .*/nproc_per_node = $gpus/" "$f" > "$st/$(basename "$f")"
done

stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log its output and how it ended
    local name=$1 limit=$2
    shift 2
    local left=$((${GPU_CHECKS_BUDGET:-100000} - SECONDS - 5))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then echo "=== $name: skipped, the budget is spent" | tee -a "$log"; return; fi
    echo "=== $name: $* (limit ${limit}s)" | tee -a "$log"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - t0))s" | tee -a "$log"
}

for s in $stages; do
    case $s in
    env)
        stage env 60 bash -c 'nvidia-smi -L; python3 -c "import torch, optuna, pydantic, sqlalchemy, transformers
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0),
      \"nccl\", torch.cuda.nccl.version(), \"optuna\", optuna.__version__, \"transformers\", transformers.__version__)"' ;;
    smoke)
        stage smoke 180 python3 -m bench.trace_profile $st/llama-gpu-small.toml --steps 3 \
            --json "$out/trace-profile-llama-gpu-small.json" --traces /tmp/traces-small ;;
    trace)
        stage trace 300 python3 -m bench.trace_profile $st/llama-gpu.toml --steps 5 \
            --json "$out/trace-profile-llama-gpu.json" --traces /tmp/traces-llama ;;
    fidelity)
        stage fidelity 150 python3 -m bench.fidelity $st/llama-gpu.toml --rounds 7 \
            --json "$out/fidelity-llama-gpu.json" ;;
    peak)
        stage peak 300 python3 -m bench.peak_memory $st/llama-gpu.toml --json "$out/peak-memory-llama-gpu.json" ;;
    ac)
        stage ac 300 python3 -m bench.trace_profile $st/llama-gpu-ac-full.toml --steps 5 \
            --json "$out/trace-profile-llama-gpu-ac-full.json" --traces /tmp/traces-ac ;;
    ac-fidelity)
        for ac in selective full; do
            stage ac-$ac-fidelity 200 python3 -m bench.fidelity $st/llama-gpu-ac-$ac.toml --rounds 7 --measure-only \
                --json "$out/fidelity-llama-gpu-ac-$ac.json"
        done ;;
    ac-selective)
        stage ac-selective-peak 200 python3 -m bench.peak_memory $st/llama-gpu-ac-selective.toml \
            --json "$out/peak-memory-llama-gpu-ac-selective.json"
        stage ac-selective-trace 200 python3 -m bench.trace_profile $st/llama-gpu-ac-selective.toml --steps 5 \
            --json "$out/trace-profile-llama-gpu-ac-selective.json" --traces /tmp/traces-ac-selective ;;
    qwen2|qwen2-trace)
        [ "$s" = qwen2 ] && stage qwen2-peak 200 python3 -m bench.peak_memory $st/qwen2-gpu.toml \
            --json "$out/peak-memory-qwen2-gpu.json"
        stage qwen2-trace 200 python3 -m bench.trace_profile $st/qwen2-gpu.toml --steps 3 \
            --json "$out/trace-profile-qwen2-gpu.json" --traces /tmp/traces-qwen2 ;;
    tune)
        stage tune 230 python3 -m jobs.cli tune $st/llama-gpu.toml
        stage best 60 python3 -m jobs.cli studies best llama-gpu --storage sqlite:///$st/llama-gpu.db
        cp $st/llama-gpu.db $st/llama-gpu.plan.json "$out/" 2>/dev/null ;;
    *) echo "unknown stage $s" | tee -a "$log" ;;
    esac
done
