#!/usr/bin/env bash
# The wheels a GPU image without network lacks, collected into .whl/ (git-ignored) so that they travel
# with the repository: Python 3.12, manylinux x86_64, the versions installed in .venv.
#
#     bash tools/gpu_wheels.sh            # here, with network; then copy the repo (with .whl/) over
#
# and on the GPU machine (the line is printed at the end):
#
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
#
# The image is assumed to have torch (CUDA), numpy, transformers, tokenizers, safetensors, sentencepiece,
# pyarrow, fsspec, huggingface-hub, tqdm, rich, pyyaml, regex, psutil, py-cpuinfo, msgpack, ninja, einops,
# packaging, pandas, xxhash, aiohttp, requests, filelock, peft, accelerate, matplotlib, nvidia-ml-py (IMAGE
# below). What the training path imports beyond that: megatron-core, deepspeed (+ hjson, pydantic and its
# deps), hydra-core, omegaconf, antlr4. `datasets` and `wandb` are imported only inside functions (a Hugging
# Face corpus, wandb logging on), so they are left out. The last step checks that every requirement of
# every wheel here is either here or in IMAGE.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${PYTHON:-$REPO/.venv/bin/python}"   # has torch: deepspeed's setup.py imports it
OUT=.whl
mkdir -p "$OUT"

# Wheels on PyPI for cp312 manylinux (pydantic-core and megatron-core are binary; the rest pure Python).
# typing-extensions: torch brings one, but pydantic 2.14 needs >= 4.14.1, newer than some images have.
BINARY=(megatron-core hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions
        hydra-core omegaconf)
# Published as sdists only: built here into pure-Python (py3-none-any) wheels.
SDIST=(deepspeed antlr4-python3-runtime)
IMAGE="numpy torch transformers tokenizers safetensors sentencepiece pyarrow fsspec huggingface-hub tqdm rich
       pyyaml regex psutil py-cpuinfo msgpack ninja einops packaging pandas xxhash aiohttp requests filelock
       peft accelerate matplotlib nvidia-ml-py"

installed_version() {  # the version pip reports for $1 in .venv
    "$PY" -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'
}

wheel_stem() {  # a wheel file's name starts with the distribution name, '-' and '.' as '_'
    echo "$1" | tr 'A-Z.-' 'a-z__'
}

have_only() {  # keep .whl/NAME-VERSION-*.whl, drop other versions of NAME; true if VERSION is there
    local stem version found=1 f
    stem="$(wheel_stem "$1")"; version="$2"
    shopt -s nocaseglob nullglob
    for f in "$OUT"/"$stem"-*.whl; do
        if [[ "$(basename "$f")" == "$stem-$version-"* ]]; then found=0; else echo "removing $f"; rm -f "$f"; fi
    done
    shopt -u nocaseglob nullglob
    return $found
}

for name in "${BINARY[@]}" "${SDIST[@]}"; do
    version="$(installed_version "$name")"
    [[ -n "$version" ]] || { echo "error: $name is not installed in $PY's environment" >&2; exit 1; }
    if have_only "$name" "$version"; then echo "have $name==$version"; continue; fi
    if [[ " ${SDIST[*]} " == *" $name "* ]]; then
        echo "building $name==$version"
        "$PY" -m pip wheel -q --no-deps --no-build-isolation "$name==$version" -w "$OUT"
    else
        echo "downloading $name==$version"
        "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux1_x86_64 -d "$OUT" "$name==$version"
    fi
done

# Completeness: every requirement that applies on CPython 3.12 / Linux (extras not requested) must be
# a wheel here or in the image. The markers are evaluated with `packaging`, as pip would.
"$PY" - "$OUT" $IMAGE <<'EOF'
import sys
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

out, image = Path(sys.argv[1]), {canonicalize_name(n) for n in sys.argv[2:]}
env = {"python_version": "3.12", "python_full_version": "3.12.0", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "extra": ""}
wheels = {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in sorted(out.glob("*.whl"))}
missing = []
for name, wheel in wheels.items():
    with zipfile.ZipFile(wheel) as z:
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(env):
            continue  # an extra, or another Python / platform
        dep = canonicalize_name(req.name)
        if dep not in wheels and dep not in image:
            missing.append(f"{wheel.name} needs {req}")
        elif dep in wheels and not req.specifier.contains(parse_wheel_filename(wheels[dep].name)[1], prereleases=True):
            missing.append(f"{wheel.name} needs {req}, .whl has {wheels[dep].name}")
print(f"{len(wheels)} wheels; every requirement is in .whl/ or the image" if not missing else "\n".join(missing))
sys.exit(1 if missing else 0)
EOF

ls -l "$OUT"/*.whl | awk '{printf "%8.1f KiB  %s\n", $5 / 1024, $9}'
total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
echo "total: $(awk -v b="$total" 'BEGIN {printf "%.1f MiB", b / 1048576}')"
if (( total > 40 * 1024 * 1024 )); then echo "error: over 40 MiB" >&2; exit 1; fi
echo "on the GPU machine, from the repository root:"
echo "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:\$PYTHONPATH"
