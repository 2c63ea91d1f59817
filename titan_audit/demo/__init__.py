"""demo/: `titan-audit demo`, the project's main job (job.py) and its G2 spot-checks (spot_checks.py).

from titan_audit import demo
ok = demo.run(Path("runs/demo"), quick=True)   # every guarantee checked; False if one failed
"""

from titan_audit.demo.job import DEMO_FILE, Plan, default_out_dir, run, vllm_status
from titan_audit.demo.spot_checks import decode_matches_full_forward, run_spot_checks

__all__ = [
    "DEMO_FILE",
    "Plan",
    "decode_matches_full_forward",
    "default_out_dir",
    "run",
    "run_spot_checks",
    "vllm_status",
]
