"""Launching, framework-neutral: topology, launcher command lines, ``dualframe run``, doctor, MPI defaults."""
from dualframe.launch.commands import (
    THREAD_VARIABLES,
    find_executable,
    horovodrun_command,
    mpirun_command,
    srun_command,
    thread_env,
)

__all__ = ["THREAD_VARIABLES", "find_executable", "horovodrun_command", "mpirun_command", "srun_command", "thread_env"]
