"""demo/: `titan-audit demo`, every guarantee proven on this machine (driver.py runs the stages of
stages/, one module per guarantee, through runner.py), and its G2 spot-checks (spot_checks.py).

from titan_audit import demo
result = demo.run(Path("runs/demo"), quick=True)   # every guarantee checked
result.passed, result.rows, result.report          # False if one failed; the verdict rows; report paths

`run(..., listener=L)` reports stages, rows and messages to a `Listener` (the CLI's draws the
progress bar and the verdict table; the default one logs).
"""

from titan_audit.demo.driver import run
from titan_audit.demo.listener import Listener
from titan_audit.demo.plan import DEMO_FILE, Plan, default_out_dir
from titan_audit.demo.spot_checks import decode_matches_full_forward, run_spot_checks
from titan_audit.demo.stages.zero_gap import vllm_status
from titan_audit.demo.verdicts import Result, Row, ordered

__all__ = [
    "DEMO_FILE",
    "Listener",
    "Plan",
    "Result",
    "Row",
    "decode_matches_full_forward",
    "default_out_dir",
    "ordered",
    "run",
    "run_spot_checks",
    "vllm_status",
]
