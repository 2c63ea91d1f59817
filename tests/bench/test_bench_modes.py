"""bench/core.time_interleaved's `modes`: a side's mode is entered around each of its batches
(calibration included) and never around another side's calls; `bench generate` holds the BI mode
around its BI sides that way (generate_suite.BI_MODE)."""

import contextlib

from titan_audit import batch_invariant
from titan_audit.bench import generate_suite
from titan_audit.bench.core import BenchOptions, time_interleaved


def test_a_sides_mode_wraps_its_batches_and_only_its_own() -> None:
    state = {"on": False, "entered": 0}
    seen: dict[str, list[bool]] = {"plain": [], "moded": []}

    @contextlib.contextmanager
    def mode():
        state["on"], state["entered"] = True, state["entered"] + 1
        try:
            yield
        finally:
            state["on"] = False

    fns = [lambda: seen["plain"].append(state["on"]), lambda: seen["moded"].append(state["on"])]
    options = BenchOptions(repeats=3, min_batch_s=1e-9)
    times = time_interleaved(fns, options, [None, mode])
    assert len(times) == 2 and all(t >= 0 for t in times)
    assert seen["moded"] and all(seen["moded"])  # every call of the moded side ran inside its mode
    assert seen["plain"] and not any(seen["plain"])  # control: the other side never did
    assert state["entered"] == 1 + options.repeats  # once for calibration, once per timed batch


def test_generate_bench_holds_the_bi_mode_and_measures_its_install() -> None:
    assert generate_suite.BI_MODE is batch_invariant.enabled
    assert not batch_invariant.is_enabled()
    assert generate_suite.mode_install_seconds(repeats=1) > 0
    assert not batch_invariant.is_enabled()  # the measurement leaves the mode as it found it
