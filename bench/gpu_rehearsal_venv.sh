#!/usr/bin/env bash
# The GPU check's rehearsal environment (bash bench/gpu_two_ranks.sh --rehearse): a fresh virtual environment that
# holds the GPU image's Python packages as closely as this machine allows, and nothing of the project's own
# dependencies (those come from the carried wheels, as on the GPU machine). Made once, kept while its recipe holds.
#
#   bash bench/gpu_rehearsal_venv.sh VENV
#
# The image ('cuda', the device tool's KINDS.md, read 2026-11-17): Python 3.12.3, torch 2.11.0+cu130, and among
# others numpy 2.5.2, scipy, numba, click, tqdm, filelock, PyYAML, packaging, MarkupSafe, accelerate 1.15.0,
# transformers 5.17.0, tokenizers 0.23.2, safetensors 0.8.0. Here: Python 3.12 from pyenv (3.12.1), torch 2.11.0
# from PyPI (its CUDA build, which runs on a CPU; about 3 GB with the NVIDIA libraries it pulls), the rest as pinned
# below or as pip resolves them.
set -euo pipefail
venv=${1:?usage: bash bench/gpu_rehearsal_venv.sh VENV}
packages=(torch==2.11.0 numpy==2.5.2 scipy numba click tqdm filelock pyyaml packaging markupsafe accelerate==1.15.0
          transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0)
recipe="${packages[*]}"
if [ -f "$venv/recipe" ] && [ "$(cat "$venv/recipe")" = "$recipe" ]; then
    exit 0
fi
python=
for candidate in python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12; do
    if "$candidate" --version >/dev/null 2>&1; then python=$candidate; break; fi  # a pyenv shim may not run
done
if [ -z "$python" ]; then
    echo "error: no Python 3.12 here (the GPU image's); install one (pyenv install 3.12) to rehearse" >&2
    exit 2
fi
rm -rf "$venv"
"$python" -m venv "$venv"
echo "=== rehearsal environment: $("$python" --version) in $venv; ${packages[*]}"
# pip's constraint file (/etc/xdg/pip, where present) caps torch at 2.14.1, which 2.11.0 satisfies
"$venv/bin/pip" install -q "${packages[@]}"
echo "$recipe" >"$venv/recipe"
"$venv/bin/python3" -c 'import torch, numpy, scipy, numba; print("torch", torch.__version__, "numpy", numpy.__version__,
    "scipy", scipy.__version__, "numba", numba.__version__)'
