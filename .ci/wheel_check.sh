#!/usr/bin/env bash
# A regular (non-editable) install works: build the wheel, install it into a fresh virtual
# environment without -e, import every module from there (not from the source tree), and run the
# README's CPU-side commands. Editable installs see the whole source tree and would hide a package
# missing from pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

python -m pip wheel --no-deps -q . -w "$work/dist"
wheel=$(ls "$work"/dist/fa3-*.whl)
echo "built $(basename "$wheel")"
python -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q torch==2.13.0    # the CPU wheel, as in .ci/run
"$py" -m pip install -q "$wheel"

# from an empty folder, so that nothing resolves to the source tree
mkdir "$work/run" && cd "$work/run"
"$py" - "$root" <<'EOF'
import importlib
import os
import pkgutil
import sys

import fa3

root = os.path.realpath(sys.argv[1])
where = os.path.realpath(fa3.__file__)
assert not where.startswith(root + os.sep), f"fa3 was imported from the source tree: {where}"
modules = ["fa3", "fa3.integrations.transformers"]  # the README's HF recipe (a no-op without transformers)
modules += [m.name for m in pkgutil.walk_packages(fa3.__path__, "fa3.") if m.name != "fa3.__main__"]
for name in sorted(set(modules)):
    importlib.import_module(name)
kernels = [m for m in modules if m.startswith("fa3.kernels.")]
assert "fa3.integrations.transformers" in sys.modules and "fa3.kernels.common.seqlen" in kernels, modules
print(f"imported {len(set(modules))} modules from {os.path.dirname(where)}, {len(kernels)} of them kernels")
print(fa3.available_kernels("attention"))  # the README's usage, minus the GPU tensors
EOF

# the README's commands that need no GPU: compile a rung for sm_90a, the demo (compile-only here)
"$py" -m fa3 compile --kernel k2 --head-dim 128 --causal --dtype bf16 --out "$work/build/k2" | tail -n 1
FA3_CACHE_DIR="$work/cache" "$py" -m fa3 demo | tail -n 1
echo "wheel check passed"
