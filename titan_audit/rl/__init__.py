"""rl/: GRPO-style post-training with the built-in generator, deterministic async rollouts and
the zero-gap on-policy report.

    from titan_audit.rl import load_rl_config, rl_train
    config = load_rl_config("rl-tiny", ["steps=50", "rollout.lag=1"])
    rl_train(config, "runs/rl", init="runs/warmup")      # a train run, an HF dir, or None

Modules (one concern each):
- generator.py   the generator interface (SamplingParams, SampleKey, GenerationRequest, Sample)
- builtin.py     the built-in generator: continuous batching, paged KV cache, keyed sampling
- sampling.py    counter-based per-sample uniforms and the batch-independent draw
- logprobs.py    the trainer's recomputation of the sampled tokens' log-probs
- tasks.py       verifiable tasks: per-step prompt sets (pure in (seed, step)) and checked rewards
- config.py      RLConfig (typed, checked) and the `rl-tiny` recipe
- rollouts.py    the rollout worker thread and the deterministic lag scheme
- loss.py        group advantages, the clipped policy-gradient loss, the zero-gap figures
- loop.py        the RL loop on trainer/ (tree reduction, AdamW, checkpoints, audit records)
- launch.py      `titan-audit rl`: one process or torchrun ranks (rank_entry.py: what torchrun runs)
- report.py      RUN/reports/onpolicy.md and the self-contained onpolicy.html
- control.py     the constructed G4 control: the generator sent the trainer's weights one ulp off
- verify.py      `titan-audit verify-onpolicy`: the zero-gap run, its control and native-ops runs, the verdict

Guarantees: G4 (in BI mode every generator log-prob equals the trainer's recomputation with the
same weights, bitwise; checked and recorded every step by `verify-onpolicy`), and for the RL
trajectory G1 (run to run), G3 (any W dividing the prompts per step), G5 (kill -9 + resume), with
any rollout lag and whatever the thread timing.
"""

from titan_audit.rl.config import RLConfig, load_rl_config
from titan_audit.rl.loop import RLResult, rl_train

__all__ = ["RLConfig", "RLResult", "load_rl_config", "rl_train"]
