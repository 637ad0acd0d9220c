"""How a worker gives the CPU to a serving engine beside it: the task thread's nice and policy, and the process's
Linux autogroup.

Why the autogroup: with `kernel.sched_autogroup_enabled=1` (most distributions' default) the kernel's fair scheduler
first shares a core between sessions (one autogroup each) and only then between the threads of one session, so a
thread's nice, and SCHED_IDLE likewise, counts only against the threads of its own session (sched(7), "The autogroup
feature"). A worker and an engine started in separate sessions (`up`, `bench serving`, two terminals, systemd units)
then split a core 50/50 however low the worker's nice: measured on this machine, two spinning processes in separate
sessions pinned to one core did 6.5 M and 6.5 M loops in 3 s with one at nice 19, 6.0 M and 5.8 M with one under
SCHED_IDLE, and 0.13 M against 7.8 M with the worker's autogroup at nice 19. Inside a container the autogroup does not
apply (the container's cgroup does: give the worker's container a low `cpu_shares`).
"""

from __future__ import annotations

import os
from pathlib import Path

AUTOGROUP_SWITCH = Path("/proc/sys/kernel/sched_autogroup_enabled")
AUTOGROUP_SELF = Path("/proc/self/autogroup")


def lower_thread_priority(nice: int, sched_idle: bool) -> None:
    """Lower the calling thread's CPU priority (Linux: both are a thread's own, and the threads it starts afterwards
    inherit them): `nice` (1-19; 0: unchanged) and, with `sched_idle`, the SCHED_IDLE policy, under which any normal
    task of the same autogroup that wakes preempts this one at once (sched(7)). Raises OSError where the platform
    refuses."""
    if nice:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    if sched_idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def lower_session_priority(nice: int, switch: Path = AUTOGROUP_SWITCH, own: Path = AUTOGROUP_SELF) -> str | None:
    """Give this process's autogroup the nice `nice` (1-19), so that the threads' priority holds against an engine in
    another session. Only where the process leads its session (`up`, `bench serving`, a service manager start it so):
    the autogroup nice is the whole session's, and a worker must not lower its starter's, a terminal's shell included.
    It never takes a session of its own either (setsid): that would cut it off from the terminal's Ctrl-C.

    Returns None when done, else why not (autogroups off or absent; the process does not lead its session; it is in
    no autogroup: `own` reads empty for a session the kernel keeps in init's root group, as in some containers and CI
    runners). Raises ValueError for a nice outside 1-19; never raises OSError (the reason is returned).
    """
    if not 1 <= nice <= 19:
        raise ValueError(f"an autogroup nice is 1-19, got {nice}")
    try:
        if switch.read_text().strip() != "1":
            return f"autogroups are off ({switch} is 0): the thread's nice holds against every process"
    except OSError:
        return "this kernel has no autogroups: the thread's nice holds against every process"
    if os.getsid(0) != os.getpid():
        return ("this process shares its session (a terminal's, a script's): its nice holds only against that "
                "session's processes. For an engine of another session, start the worker as a session of its own: "
                "under a service manager, or `setsid -w sparecycles worker ...` (then stop it with SIGTERM: the "
                "terminal's Ctrl-C no longer reaches it)")
    try:
        if not own.read_text().strip():
            return ("this process's session is in no autogroup (the kernel keeps it in the root group, as for init's "
                    "session): its nice holds against the processes of that group only")
        own.write_text(str(nice))
    except OSError as exc:
        return f"the kernel refused the autogroup nice ({exc})"
    return None
