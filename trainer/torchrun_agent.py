"""torchrun's agent as `train --nproc-per-node` and `up --nproc-per-node` start it (trainer.launch.launch_torchrun):
`torch.distributed.run.main`, except that a stop by signal ends it with one line and status 128 + the signal.

Why: torchrun's own handler of SIGTERM/SIGINT stops the ranks (they checkpoint after the same step) and then raises
`SignalException` out of `main`, which Python prints as a ~25-line traceback between the ranks' "stopped after step N"
lines and the launcher's message that points at them. The stop is the one the user asked for, not an error.

Run as `python -m trainer.torchrun_agent [torchrun's arguments]`.
"""

from __future__ import annotations

import sys


def main() -> int:
    """torchrun's `main` with sys.argv's arguments; returns 0 when it returns, 128 + signal number after a stop by
    signal (torch.distributed.elastic.multiprocessing.api.SignalException). Any other error propagates as torchrun's
    would (its traceback is the diagnosis)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main()
    except SignalException as exc:
        print(f"torchrun: stopped by {exc.sigval.name}; its ranks were told to stop", file=sys.stderr)
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
