"""`titan-audit train` on two nodes through torchrun's c10d rendezvous (two launchers on this
machine, `--nproc 1` each, a shared run directory), in one launch, to stay within the suite's
time: node 1 (its whole process group) is SIGKILLed after the step-2 checkpoint; node 0 exits 1
with one line, no traceback, and no process of either launcher is left; `--resume` on one node
(W=1) finishes the run, and its audit records (steps 1-2 from two nodes, 3-4 from one) equal a
one-node run's bitwise (`compare`; W-invariant, G5, so the reference is the cheap W=1 run), and a
copy of the reference with one hash bit flipped does not (the negative control). Bad flags exit 2
with one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import psutil
import pyarrow.parquet as pq
import pytest
from command_line import cli, cli_here, one_line_error

from titan_audit.audit import compare_runs

STEPS = ["--config", "tiny-dense", "--steps", "4", "--set", "checkpoint.interval=1", "--set", "parallel.threads=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(out, rank: int, port: int) -> subprocess.Popen:
    args = ["train", *STEPS, "--out", str(out), "--nproc", "1", "--nnodes", "2", "--node-rank", str(rank)]
    return subprocess.Popen(
        [sys.executable, "-m", "titan_audit.cli", *args, "--rdzv-endpoint", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a node is killed whole
    )


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("mn") / "ref"
    done = cli("train", *STEPS, "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_killed_node_is_one_line_and_the_two_node_run_resumes_on_one_node(reference, tmp_path):
    out = tmp_path / "run"
    port = _free_port()
    node0, node1 = _node(out, 0, port), _node(out, 1, port)
    try:
        deadline = time.monotonic() + 240
        while not (out / "checkpoints" / "step_00000002").is_dir():
            assert time.monotonic() < deadline, "no step 2 checkpoint"
            assert node0.poll() is None and node1.poll() is None, (node0.poll(), node1.poll())
            time.sleep(0.05)
        processes = [psutil.Process(p.pid) for p in (node0, node1)]
        processes += [c for p in list(processes) for c in p.children(recursive=True)]
        os.killpg(node1.pid, signal.SIGKILL)
        _, err = node0.communicate(timeout=120)
    finally:
        for p in (node0, node1):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert node0.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[rank ")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), err[-3000:]
    assert "lost its connection" in lines[0] and "--resume" in lines[0], lines[0]
    assert "Traceback" not in err
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], alive
    history = json.loads((out / "manifest.json").read_text())["world_size_history"]
    assert [h["world_size"] for h in history] == [2]

    resumed = cli("train", "--out", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    history = json.loads((out / "manifest.json").read_text())["world_size_history"]
    assert [h["world_size"] for h in history[:1]] == [2] and history[-1]["world_size"] == 1, history
    assert history[-1]["start_step"] >= 2, history
    result = compare_runs(reference, out)
    assert result.identical and result.compared == result.records_a, result.first_divergence

    flipped = tmp_path / "flipped"  # the negative control: one bit of one record's hash
    shutil.copytree(reference, flipped)
    part = sorted((flipped / "audit").glob("*.parquet"))[0]
    table = pq.read_table(part)
    hashes = table.column("hash").to_pylist()
    hashes[-1] = f"{int(hashes[-1][0], 16) ^ 1:x}" + hashes[-1][1:]
    pq.write_table(table.set_column(table.schema.get_field_index("hash"), "hash", [hashes]), part)
    assert compare_runs(reference, flipped).differing == 1


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1", "--nproc", "1"], r"--node-rank 2 is outside"),
        (["--nnodes", "2", "--rdzv-endpoint", "nohost", "--nproc", "1"], r"--rdzv-endpoint 'nohost'"),
        (["--nnodes", "2", "--nproc", "1"], r"--nnodes needs --rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1"], r"--nnodes needs --nproc"),
        (["--node-rank", "1"], r"--node-rank needs --nnodes"),
        (["--nnodes", "0", "--rdzv-endpoint", "h:1", "--nproc", "1"], r"--nnodes must be >= 1"),
    ],
)
@pytest.mark.parametrize("command", ["train", "rl"])
def test_bad_multinode_flags_exit_2(tmp_path, command, flags, pattern):
    one_line_error(cli_here(command, "--out", str(tmp_path / "run"), *flags), pattern)
    assert not (tmp_path / "run").exists()


def test_node_1_of_a_resume_needs_the_run(tmp_path):
    flags = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "127.0.0.1:1", "--nproc", "1", "--resume"]
    one_line_error(cli_here("train", "--out", str(tmp_path / "none"), *flags), r"no run to resume")
