"""G2 batch invariance: spot-checks of attention (batch, decode, chunked prefill), matmul,
log_softmax and rms_norm at the plan's head dims, and the model's KV-cache decode (native ops
reported, not counted); negative control: the KV-cache decode summed in the other gemm order must
differ from the full forward.

Guarantees: the checks themselves live in demo/spot_checks.py; this stage records them in
demo.json (`spot_checks`) and turns them into the G2 rows.
"""

from __future__ import annotations

from titan_audit.demo.runner import Demo


def spot_checks(demo: Demo) -> None:
    from titan_audit.batch_invariant import GEMM_ORDERS, current_gemm_order
    from titan_audit.demo.spot_checks import MODEL, decode_matches_full_forward, run_spot_checks

    checks = run_spot_checks(demo.plan.head_dims)
    demo.extra["spot_checks"] = [c.to_dict() for c in checks]
    bad = [c for c in checks if not c.passed]
    native = sum(c.native == "differs" for c in checks)
    demo.row(
        "G2 batch invariance",
        f"{len(checks)} spot-checks: attention (batch, decode, chunked), matmul, log_softmax, "
        f"rms_norm at head dims {', '.join(map(str, demo.plan.head_dims))}; model KV decode",
        not bad,
        (
            f"all identical; native ops differ in {native} of {len(checks)} (reported, not counted)"
            if not bad
            else f"DIFFERENT: {'; '.join(c.check + ' ' + c.shape for c in bad[:3])}"
        ),
        "report: Batch invariance spot-checks",
    )
    order = current_gemm_order()
    other = next(o for o in GEMM_ORDERS if o != order)
    differs = not decode_matches_full_forward(True, decode_gemm_order=other)
    demo.row(
        "G2 control",
        f"model {MODEL} KV-cache decode in gemm order {other} vs the full forward in {order} must differ",
        differs,
        "differs" if differs else "identical: the decode check proves nothing here",
        "report: Batch invariance spot-checks",
    )
