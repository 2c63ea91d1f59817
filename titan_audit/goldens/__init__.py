"""The project's committed goldens, shipped as package data (an installed package has them too).

    from titan_audit.goldens import GOLDENS_DIR
    check_golden(run_dir, GOLDENS_DIR / "tiny-dense-bi", require_exact=True)

Each `GOLDENS_DIR/<name>/` is a golden run directory (golden.json with the sha256 of every file,
manifest.json, metrics.parquet, audit/*.parquet; see titan_audit.golden):
- tiny-dense: `titan-audit train --config tiny-dense --steps 4` (native ops: exact where the
  numerics fingerprint is compatible, tolerance mode elsewhere);
- tiny-dense-bi: the same in batch-invariant mode (exact on every CPU);
- tiny-moe: the MoE recipe, 4 steps;
- rl-tiny: 3 GRPO steps of `rl-tiny` from a BI warm-up (exact on every CPU).
They were recorded once and are checked on every machine (`titan-audit demo` uses tiny-dense and
tiny-dense-bi; tests/golden/test_committed_goldens.py all four): never edit them by hand;
`pytest tests/golden --golden-update` rewrites them deliberately. The kernel golden stays in
tests/golden/kernels.json.
"""

from pathlib import Path

GOLDENS_DIR = Path(__file__).resolve().parent
