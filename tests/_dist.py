"""Launching several CPU processes from a test: one place for the environment, the time limit
(a bound on a hang only: past it the whole process session is killed, torchrun and every rank it
started, which subprocess.run's own timeout would leave running) and the torchrun command line.
Used by test_parallel.py, test_parallel_nd.py and test_parallel_loop.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 600   # bounds a hang only: a 2-rank launch takes 10-30 s on 2 busy cores
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def env(**extra: str) -> dict:
    """This process's environment without a launcher's variables, one thread per rank, and the
    checkout first on PYTHONPATH; `extra` on top."""
    out = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    out.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), out.get("PYTHONPATH", "")]))
    out.update(extra)
    return out


def run(cmd: list[str], timeout: float = LAUNCH_TIMEOUT_S, **extra_env: str) -> subprocess.CompletedProcess:
    """cmd in the test environment, from the checkout's root; past `timeout` its whole session
    is killed and the test fails naming the command."""
    proc = subprocess.Popen(cmd, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd[1:6])} ... ran past {timeout} s:\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun_cmd(nproc: int, *target: str) -> list[str]:
    """`torchrun --standalone --nproc_per_node N TARGET...` (TARGET: a script and its arguments,
    or "-m", a module and its arguments); --standalone picks its own free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc_per_node", str(nproc), *target]


def torchrun(nproc: int, *target: str, expect_ok: bool = True) -> subprocess.CompletedProcess:
    """Run torchrun_cmd(nproc, *target); a failure (when expected to succeed) shows its stderr."""
    proc = run(torchrun_cmd(nproc, *target))
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


def free_port() -> int:
    """A TCP port free a moment ago (another process may take it before it is used)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT_TAKEN = ("EADDRINUSE", "address already in use")


def run_pair(script: Path, args: list[str], timeout_s: float, deadline_s: float = LAUNCH_TIMEOUT_S,
             attempts: int = 3) -> tuple[list[subprocess.Popen], int, str]:
    """Two ranks of `script args` started directly with torchrun's environment variables (no
    agent that would tear the survivor down), so the survivor's own reaction is what gets
    tested; LOGITLAB_TEST_TIMEOUT_S=timeout_s is their collective timeout. -> (both processes,
    rank 0's exit status, rank 0's stderr). Rank 0 serves the store on a port that was free a
    moment before; when another process took it in between, the pair starts again on a new one."""
    for _ in range(attempts):
        port, procs = str(free_port()), []
        for rank in (0, 1):
            rank_env = env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port, LOGITLAB_TEST_TIMEOUT_S=str(timeout_s))
            procs.append(subprocess.Popen([sys.executable, str(script), *args], env=rank_env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, cwd=ROOT))
        try:
            _, err = procs[0].communicate(timeout=deadline_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.communicate()
        if not (procs[0].returncode != 0 and any(m in err for m in PORT_TAKEN)):
            return procs, procs[0].returncode, err
    raise AssertionError(f"rank 0 found its store port taken {attempts} times:\n{err[-2000:]}")
