"""Run a multi-process launcher (torchrun, Lightning's DDP) for a test, and make sure that it
left no process behind: the command runs in a session of its own, and when it has returned,
every process still in that session (a rank that outlived its launcher, a DataLoader worker) is
killed and reported as a failure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil

from .conftest import wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _session(sid: int) -> dict[int, str]:
    """pid -> name of the live processes in session `sid`."""
    found = {}
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found[proc.pid] = proc.name()
        except (ProcessLookupError, PermissionError, psutil.NoSuchProcess):
            pass
    return found


def _kill_session(sid: int) -> None:
    try:
        os.killpg(sid, signal.SIGKILL)  # the launcher leads its session: its group is the session's
    except ProcessLookupError:
        pass
    for pid in _session(sid):  # those that made groups of their own
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_python(*args: str, torchrun_ranks: int | None = None, cwd: str = REPO,
               timeout: float = 150) -> subprocess.CompletedProcess:
    """`python ARGS...` (`-m module ...` or `script.py ...`), or under `torchrun --standalone
    --nproc_per_node=torchrun_ranks`, with this checkout first on the path and one thread per
    process; raises AssertionError if it failed, timed out or left processes running."""
    command = [sys.executable]
    if torchrun_ranks is not None:
        command += ["-m", "torch.distributed.run", "--standalone",
                    f"--nproc_per_node={torchrun_ranks}"]
    command += list(args)
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_session(proc.pid)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"{args} ran past {timeout} s:\n{stdout[-3000:]}\n{stderr[-6000:]}") from None
    # Workers exit on their own a moment after their parent; anything left after that leaked.
    wait_until(lambda: not _session(proc.pid), timeout=10)
    left = _session(proc.pid)
    if left:
        _kill_session(proc.pid)
    assert proc.returncode == 0, f"{args} failed:\n{stdout[-3000:]}\n{stderr[-8000:]}"
    assert not left, f"{args} left processes running after it returned: {left}"
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)
