"""Child processes (tensor-parallel workers, data-parallel replicas): they die with their parent,
are stopped within a deadline, and one that dies while starting says why that usually is."""
import ctypes
import os
import signal
import time


def die_with_parent(parent_pid: int):
    """Have the kernel kill this process when its parent exits, however it exits (Linux
    prctl PR_SET_PDEATHSIG); Ctrl-C is left to the parent, which stops its children itself."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's pipe closing still ends the child's loop
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def died_while_starting(name: str, exitcode: int | None) -> RuntimeError:
    """The error for a child that exited before it began its work: most often a script that creates
    the LLM at module level, which each spawned child imports again and dies in the bootstrap of."""
    return RuntimeError(f"{name} exited with code {exitcode} while starting (its error is printed above). Workers and "
                        "replicas are spawned: each imports your main module again, so a script must create the LLM "
                        'under `if __name__ == "__main__":`')


def stop_processes(procs, conns, timeout: float):
    """Send None (the exit message) on each pipe, give the processes `timeout` seconds in all to
    exit, then kill the rest."""
    for conn in conns:
        try:
            conn.send(None)
            conn.close()
        except OSError:
            pass  # the process is already gone
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()
