"""The launcher: a job (train or RL) on N local ranks, or on several nodes, through torchrun.

One concern a module: `rendezvous` (the nodes and ranks a launch runs on), `spec` (the typed
launch options and the job spec), `start` (config, checks, launch), `supervisor` (torchrun, its
stderr and the stop signals), `launch_dirs` (what outlives a launcher), `rank` (a rank's entry).
"""

from titan_audit.trainer.launch.rendezvous import AUTO_NPROC, Rendezvous, resolve_nproc, usable_cores, world_size_of
from titan_audit.trainer.launch.spec import JobSpec, LaunchOptions
from titan_audit.trainer.launch.start import launch, start

__all__ = [
    "AUTO_NPROC",
    "JobSpec",
    "LaunchOptions",
    "Rendezvous",
    "launch",
    "resolve_nproc",
    "start",
    "usable_cores",
    "world_size_of",
]
