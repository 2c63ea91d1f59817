"""demo/: `titan-audit demo`, the project's main job (job.py) and its G2 spot-checks (spot_checks.py).

from titan_audit import demo
result = demo.run(Path("runs/demo"), quick=True)   # every guarantee checked
result.passed, result.rows, result.report          # False if one failed; the verdict rows; report paths

`run(..., listener=L)` reports stages, rows and messages to a `Listener` (the CLI's draws the
progress bar and the verdict table; the default one logs).
"""

from titan_audit.demo.job import DEMO_FILE, Listener, Plan, Result, default_out_dir, run, vllm_status
from titan_audit.demo.spot_checks import decode_matches_full_forward, run_spot_checks

__all__ = [
    "DEMO_FILE",
    "Listener",
    "Plan",
    "Result",
    "decode_matches_full_forward",
    "default_out_dir",
    "run",
    "run_spot_checks",
    "vllm_status",
]
