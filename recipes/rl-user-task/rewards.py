"""The reward functions of the user-task recipe (recipes/rl-user-task.toml), in TRL's signature.

Both are pure functions of (completion, answer), so a run scores every sample the same way on any
machine, and TRL's GRPOTrainer can call them unchanged (they take its extra arguments in **columns).
"""


def exact(prompts, completions, answer, **columns):
    """1.0 when the completion (stripped) is the answer, else 0.0."""
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def letters(prompts, completions, answer, **columns):
    """Partial credit: the letters in their place, #{i : c[i] == a[i]} / max(len(c), len(a)), over
    the stripped completion c; 0.0 for an empty completion."""
    scores = []
    for completion, target in zip(completions, answer):
        text = completion.strip()
        longest = max(len(text), len(target))
        scores.append(sum(x == y for x, y in zip(text, target)) / longest if longest else 0.0)
    return scores
