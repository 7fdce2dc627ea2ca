"""The launcher's child: ``python -m trainkit.distributed.script_runner script.py args...`` runs the
script as ``python script.py args...`` would (as ``__main__``, with its ``sys.argv`` and its folder
first on ``sys.path``), and sees how it ends. Where the script raises ``SystemExit`` with a failing
status (``sys.exit(3)``, argparse's usage error) on one process of a launched multi-process job
after ``jax.distributed`` started, that process ends at once with its status and a line saying so
(:func:`trainkit.distributed.processes.leave_now`): left to the normal interpreter exit, JAX's
shutdown barrier waits for the peers, which wait for this process, until the coordination
service aborts the others first and the launcher blames a survivor, the status lost. Nothing of
JAX or trainkit is imported before the script runs (it may set ``JAX_PLATFORMS`` first).

>>> failing(3), failing("usage: ..."), failing(0), failing(None)
(True, True, False, False)
"""

from __future__ import annotations

import os
import runpy
import sys


def failing(code: object) -> bool:
    """Whether a ``SystemExit`` with ``code`` is a failing exit (Python's rule: ``None`` and 0 succeed)."""
    return code is not None and code != 0


def run(script: str, args: list[str]) -> None:
    """``script`` run as ``__main__`` with ``args``; see the module."""
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` puts it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as error:
        if failing(error.code) and "jax" in sys.modules:  # the script imported JAX: it may have joined the job
            from trainkit.distributed import processes

            if processes.is_initialized():
                processes.leave_now(error, f"{os.path.basename(script)} (outside fit)")
        raise


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m trainkit.distributed.script_runner script.py [args...]")
    run(sys.argv[1], sys.argv[2:])
