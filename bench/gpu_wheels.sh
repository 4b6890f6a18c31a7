#!/usr/bin/env bash
# Gather into .whl/ the wheels the GPU check (bench/gpu_two_ranks.sh) carries to an offline GPU machine: the project's
# runtime dependencies that the GPU image lacks, with their own dependencies that it lacks too, for CPython 3.12 on
# manylinux x86_64. Run it where a package registry is reachable:
#
#   bash bench/gpu_wheels.sh      # then: bash bench/gpu_two_ranks.sh --rehearse OUT (here), or OUT (on the GPU)
#
# pip resolves pyproject.toml's dependencies (torch excepted: the image's own runs) for that platform; the wheels of
# what the image already holds are dropped. The image ('cuda', as last read on 2026-11-17 in the device tool's
# KINDS.md) holds Python 3.12.3 and torch 2.11.0 with numpy, scipy, numba, llvmlite, click, tqdm, filelock, PyYAML,
# packaging, MarkupSafe, typing-extensions and accelerate; it lacks optuna, pydantic, sqlalchemy and alembic.
# A run carries at most 64 MiB in all, so the total is checked against a budget that leaves room for the tree.
set -euo pipefail
cd "$(dirname "$0")/.."
budget_mib=${GPU_WHEELS_BUDGET_MIB:-32}
# Distributions the image holds (normalized names, as wheel files spell them): not carried.
# typing-extensions is carried all the same: pydantic asks for a newer one than the image may hold.
image_has="numpy scipy numba llvmlite click tqdm filelock pyyaml packaging markupsafe accelerate torch triton setuptools"
deps=$(python3 - <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(" ".join(d for d in project["dependencies"] if not re.match(r"torch\b", d)))
EOF
)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck disable=SC2086
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$tmp" $deps 2>&1 | { grep -v "^WARNING: Location" || true; }
rm -rf .whl && mkdir -p .whl
for wheel in "$tmp"/*.whl; do
    name=$(basename "$wheel" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
    case " $(echo $image_has) " in
        *" $name "*) ;;
        *) cp "$wheel" .whl/ ;;
    esac
done
total=$(du -cb .whl/*.whl | tail -1 | cut -f1)
ls -1 .whl
echo "carried: $(ls .whl/*.whl | wc -l) wheels, $((total / 1024)) KiB in .whl/ (budget ${budget_mib} MiB of the 64 MiB a run carries)"
if [ "$total" -gt $((budget_mib * 1024 * 1024)) ]; then
    echo "error: the wheels take $((total / 1024 / 1024)) MiB, over ${budget_mib} MiB: drop one the image has" >&2
    exit 1
fi
