#!/usr/bin/env bash
# GPU check for the Triton backend (issue 16): the `gpu` tests, then `bench ops --json` (Triton
# vs cuBLAS / SDPA in the same run), then a short table. One H200/H100-class GPU, under 8 minutes.
#
# Prep, once, on the development machine, in the repo root (the GPU machine has no network; its
# image has torch, triton, pytest, hypothesis, xxhash, click, pyarrow, rich, matplotlib and
# safetensors, but not zarr, which titan_audit.audit imports):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
#     zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0
#   make kernels        # titan_audit/batch_invariant/cpu/_titan_bi.so, for bench ops' CPU cases
# Run, with the device tool, from the repo root:
#   run(command="bash scripts/gpu_check.sh", timeout_s=540,
#       carry=[".whl", "titan_audit/batch_invariant/cpu/_titan_bi.so"])
# Outputs (under $OUT when set, else /tmp/gpu_check): gpu_tests.log, bench_ops.json, bench_ops.log.
# Exit status: 0 when the tests pass (missed speed targets are reported, not failed), else 1.
set -uo pipefail
OUT_DIR=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT_DIR"
SITE=/tmp/titan_audit_site
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 2
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpu', torch.cuda.get_device_name())" || exit 2

tests=(tests/batch_invariant/test_gpu_ops.py)
for f in tests/*/test_gpu_*.py tests/test_gpu_*.py; do
    [ -e "$f" ] && [ "$f" != "${tests[0]}" ] && tests+=("$f")
done
echo "== pytest -m gpu ${tests[*]}"
timeout 270 "$PY" -m pytest -m gpu -q -p no:cacheprovider -rs "${tests[@]}" 2>&1 | tee "$OUT_DIR/gpu_tests.log"
test_rc=${PIPESTATUS[0]}

echo "== titan-audit bench ops --json"
timeout 240 "$PY" -c "from titan_audit.cli.main import main; main()" bench ops --json \
    >"$OUT_DIR/bench_ops.json" 2>"$OUT_DIR/bench_ops.log"
bench_rc=$?
tail -3 "$OUT_DIR/bench_ops.log"

"$PY" - "$OUT_DIR/bench_ops.json" "$test_rc" "$bench_rc" <<'PYEOF'
import json, sys
path, test_rc, bench_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    result = json.load(open(path))
except (OSError, ValueError) as exc:
    result = {"cases": []}
    print(f"bench ops: no JSON ({exc}), exit {bench_rc}")
cases = [c for c in result["cases"] if c["case"].startswith("cuda ")]
gpu = cases[0].get("device", "?") if cases else "?"
print(f"\n== Triton backend vs cuBLAS / SDPA on {gpu} (ratio = ours / theirs, time; lower is better)")
print(f"{'case':<66} {'base ms':>9} {'ours ms':>9} {'ratio':>7} {'target':>7}  met")
for c in cases:
    target = "-" if c["target"] is None else f"{c['target']:.3g}"
    met = {True: "yes", False: "NO", None: ""}[c["met_target"]]
    print(f"{c['case'][5:]:<66} {c['baseline_s'] * 1e3:9.3f} {c['candidate_s'] * 1e3:9.3f} {c['ratio']:7.3f} {target:>7}  {met}")
print(f"gpu tests: {'passed' if test_rc == 0 else f'FAILED (exit {test_rc})'}; bench ops exit {bench_rc}; "
      f"targets missed: {sum(c['met_target'] is False for c in cases)} of {sum(c['target'] is not None for c in cases)}")
PYEOF
[ "$test_rc" -eq 0 ]
