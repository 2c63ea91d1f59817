#!/usr/bin/env bash
# GPU check: what titan-audit proves on one CUDA GPU (issue 27), in under 5 minutes, every figure
# in one JSON file that is rewritten after each stage (a run cut short keeps what it measured).
#
# What the GPU machine needs (it has no network), copied from a checkout of this repository:
#   - the repository's files (a working tree; no install step: the script runs from the tree);
#   - .whl/       wheels of the pure-Python and small binary dependencies the GPU machine's image
#                 may lack, for CPython 3.12 on x86-64 Linux; fetched here by
#                   bash scripts/gpu_check.sh --fetch-wheels
#                 and installed there only for the modules that do not import already;
#   - titan_audit/batch_invariant/cpu/_titan_bi.so   built here by `make kernels` (the model's
#                 weight init and RoPE table run on it, and bench ops' CPU cases).
#   torch, triton, numpy, pyarrow and matplotlib come from the GPU machine's own image (too large to
#   copy); the env stage records their versions and any module that is missing.
# Check here that everything is in place and see the plan:   bash scripts/gpu_check.sh --dry-run
# Run there, from the repository root:                       bash scripts/gpu_check.sh
# Results under $OUT (default /tmp/gpu_check): gpu_check.json (stages: status, seconds, figures)
# and each stage's log. Exit status: 0 when every stage passed (a missed speed target is a figure,
# not a failure), 1 when a stage failed or timed out, 2 when the machine cannot run the check.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEEL_DIR=${WHEEL_DIR:-.whl}
KERNELS=titan_audit/batch_invariant/cpu/_titan_bi.so
BUDGET_S=${BUDGET_S:-285}  # the whole run; each stage gets at most its cap and what is left
# The wheels (name==version, as pip names them) and the modules they provide.
WHEELS=(zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 pyyaml==6.0.4
    typing_extensions==4.16.0 packaging==26.4 xxhash==4.1.0 click==8.5.1 safetensors==0.8.0 tqdm==4.70.1
    rich==15.0.0 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 hypothesis==6.170.17
    sortedcontainers==2.4.0 attrs==26.1.0 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1)
MODULES=(torch triton numpy pyarrow matplotlib zarr xxhash click safetensors rich tqdm pytest hypothesis yaml)
GPU_TESTS=(tests/batch_invariant/test_gpu_ops.py tests/batch_invariant/test_gpu_embedding.py tests/audit/test_device_lanes.py
    tests/audit/test_later_records.py
    tests/batch_invariant/test_triton_pointwise.py tests/models/test_triton_model.py)
DEVICE_TESTS=(tests/trainer/test_device_key.py)  # G1 / G5 / G4 runs on cuda through the CLI, with controls
INTERPRETER_TESTS=(tests/batch_invariant/test_triton_mode.py tests/batch_invariant/test_mode.py)
STAGES="env (15 s), gpu_tests: pytest -m gpu ${GPU_TESTS[*]} (100 s), bench_ops: titan-audit bench ops
  --json, Triton vs cuBLAS / SDPA (60 s), g1_train: BI tiny-dense 3 steps on cuda twice + compare (45 s),
  g4_onpolicy: verify-onpolicy rl-tiny 2 steps on cuda, built-in generator (45 s), device_runs: pytest -m gpu
  ${DEVICE_TESTS[*]} (G1 with a native control, G5 resume on cuda + replay on the CPU, G4 with a control; 90 s),
  interpreter: pytest -m triton ${INTERPRETER_TESTS[*]} against this torch's CUDA SDPA signatures (40 s);
  in this order, the most telling first: a stage gets its cap or what is left of the budget"

wheel_file() {  # the .whl file of name==version in WHEEL_DIR, if any
    local name=${1%%==*} version=${1##*==}
    ls "$WHEEL_DIR"/"${name//-/_}"-"$version"-*.whl "$WHEEL_DIR"/"$name"-"$version"-*.whl 2>/dev/null | head -1
}

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p "$WHEEL_DIR"
    exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEEL_DIR" "${WHEELS[@]}"
fi

if [ "${1:-}" = "--dry-run" ]; then
    missing=0
    for w in "${WHEELS[@]}"; do
        f=$(wheel_file "$w")
        if [ -z "$f" ]; then echo "missing wheel: $w in $WHEEL_DIR/ (bash scripts/gpu_check.sh --fetch-wheels)"; missing=1; fi
    done
    if [ ! -f "$KERNELS" ]; then
        echo "missing: $KERNELS (make kernels)"; missing=1
    elif ! "$PY" -c "from titan_audit.batch_invariant.cpu import kernel_library as k; k.library()" 2>/dev/null; then
        echo "stale or foreign: $KERNELS (make kernels)"; missing=1
    fi
    for f in "${GPU_TESTS[@]}" "${DEVICE_TESTS[@]}" "${INTERPRETER_TESTS[@]}" scripts/gpu_check_record.py; do
        [ -f "$f" ] || { echo "missing: $f"; missing=1; }
    done
    size=$(du -cb "$WHEEL_DIR" "$KERNELS" 2>/dev/null | tail -1 | cut -f1)
    echo "to copy besides the repository: $WHEEL_DIR/ and $KERNELS, $((size / 1048576)) MiB"
    echo "plan (budget ${BUDGET_S} s; caps): $STAGES"
    echo "outputs: \$OUT/gpu_check.json and one log per stage"
    [ "$missing" -eq 0 ] && { echo "dry run: ready"; exit 0; }
    echo "dry run: not ready"; exit 2
fi
[ $# -eq 0 ] || { echo "usage: bash scripts/gpu_check.sh [--dry-run | --fetch-wheels]"; exit 2; }

OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR"
JSON=$OUT_DIR/gpu_check.json
rm -f "$JSON"
SITE=${SITE:-/tmp/titan_audit_site}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + BUDGET_S))
failed=0
cap() { local left=$((DEADLINE - SECONDS)); [ "$left" -lt "$1" ] && echo $((left > 1 ? left : 1)) || echo "$1"; }
record() {  # stage rc start kind [artifact]
    "$PY" scripts/gpu_check_record.py "$JSON" "$1" "$2" "$((SECONDS - $3))" "${@:4}"
    [ "$2" -eq 0 ] || failed=1
}
ta() { "$PY" -c "from titan_audit.cli.main import main; main()" "$@"; }
pytest_stage() {  # stage cap marker files...: the files' tests of that marker, JUnit XML -> the JSON
    local stage=$1 limit marker=$3 t=$SECONDS
    limit=$(cap "$2")
    timeout "$limit" "$PY" -m pytest -m "$marker" -q -p no:cacheprovider -rs --junitxml="$OUT_DIR/$stage.xml" \
        "${@:4}" >"$OUT_DIR/$stage.log" 2>&1
    record "$stage" $? "$t" pytest "$OUT_DIR/$stage.xml"
    tail -3 "$OUT_DIR/$stage.log"
}

# -- env: versions, the GPU, and the wheels for modules this image lacks
t=$SECONDS
absent=()
for m in "${MODULES[@]}"; do "$PY" -c "import $m" 2>/dev/null || absent+=("$m"); done
if [ ${#absent[@]} -gt 0 ] && [ -d "$WHEEL_DIR" ]; then
    names=()
    for w in "${WHEELS[@]}"; do names+=("${w%%==*}"); done
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
        --find-links "$WHEEL_DIR" "${names[@]}" >"$OUT_DIR/env.log" 2>&1
fi
"$PY" - "$OUT_DIR/env.json" "${absent[*]:-}" <<'PYEOF' 2>>"$OUT_DIR/env.log"
import importlib, json, platform, subprocess, sys
env = {"python": platform.python_version(), "absent_before_wheels": sys.argv[2].split()}
for name in ("torch", "triton", "numpy", "pyarrow", "zarr"):
    try:
        env[name] = importlib.import_module(name).__version__
    except Exception as exc:
        env[name] = f"missing: {exc}"
try:
    import torch
    env["cuda"] = torch.version.cuda
    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=10)
    env["nvidia_smi"] = smi.stdout.strip()
except Exception as exc:
    env["gpu"] = None
    env["error"] = str(exc)
json.dump(env, open(sys.argv[1], "w"), indent=2)
print(json.dumps(env))
sys.exit(0 if env.get("gpu") and not str(env.get("triton", "missing")).startswith("missing") else 2)
PYEOF
rc=$?
record env "$rc" "$t" env "$OUT_DIR/env.json"
[ "$rc" -eq 0 ] || { echo "no usable CUDA GPU with torch + triton here (see $JSON)"; exit 2; }

# -- the gpu tests (Triton kernels compiled; the model-level proofs on CUDA tensors)
pytest_stage gpu_tests 100 gpu "${GPU_TESTS[@]}"

# -- bench ops: Triton vs cuBLAS / SDPA in the same run (targets: matmul >= 0.8x cuBLAS, decode >= 0.7x SDPA)
t=$SECONDS
timeout "$(cap 60)" "$PY" -c "from titan_audit.cli.main import main; main()" bench ops --json \
    >"$OUT_DIR/bench_ops.json" 2>"$OUT_DIR/bench_ops.log"
record bench_ops $? "$t" bench "$OUT_DIR/bench_ops.json"

# -- G1 on the GPU: a BI tiny-dense run, twice, compared record by record
t=$SECONDS
runs=$OUT_DIR/runs
rm -rf "$runs/g1_a" "$runs/g1_b"
g1=(train --config tiny-dense --steps 3 --set determinism.batch_invariant=true --set parallel.device=cuda)
limit=$(cap 45)
( timeout "$limit" "$PY" -c "from titan_audit.cli.main import main; main()" "${g1[@]}" --out "$runs/g1_a" &&
  timeout "$limit" "$PY" -c "from titan_audit.cli.main import main; main()" "${g1[@]}" --out "$runs/g1_b" &&
  ta compare "$runs/g1_a" "$runs/g1_b" --json >"$OUT_DIR/g1_compare.json" ) >"$OUT_DIR/g1_train.log" 2>&1
record g1_train $? "$t" compare "$OUT_DIR/g1_compare.json"

# -- G4 on the GPU: the built-in generator's log-probs against the trainer's, every step
t=$SECONDS
rm -rf "$runs/g4"
timeout "$(cap 45)" "$PY" -c "from titan_audit.cli.main import main; main()" verify-onpolicy --config rl-tiny \
    --steps 2 --out "$runs/g4" --set parallel.device=cuda --json >"$OUT_DIR/g4_onpolicy.json" 2>"$OUT_DIR/g4_onpolicy.log"
record g4_onpolicy $? "$t" onpolicy "$OUT_DIR/g4_onpolicy.json"

# -- G1 / G5 / G4 on cuda as tests, each with its control (tests/trainer/test_device_key.py)
pytest_stage device_runs 90 gpu "${DEVICE_TESTS[@]}"

# -- the interpreter tests against this machine's torch and Triton (the CUDA SDPA override signatures)
pytest_stage interpreter 40 triton "${INTERPRETER_TESTS[@]}"

echo "== $JSON"
"$PY" - "$JSON" <<'PYEOF'
import json, sys
result = json.load(open(sys.argv[1]))
for name, stage in result["stages"].items():
    print(f"{name:<12} {stage['status']:<8} {stage['seconds']:>6} s")
bench = (result["stages"].get("bench_ops") or {}).get("figures") or {}
for case in bench.get("cases", []):
    met = {True: "met", False: "MISSED", None: ""}[case["met_target"]]
    print(f"  {case['case'][5:]:<64} ratio {case['ratio']:.3f} target {case['target']}  {met}")
PYEOF
[ "$failed" -eq 0 ] && exit 0 || exit 1
