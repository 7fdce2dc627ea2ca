"""``python -m trainkit.launch --nproc N script.py``: the entry point of
:mod:`trainkit.distributed.launch` (N processes of one script on this machine)."""

import sys

from trainkit.distributed.launch import build_env, free_port, launch, main

__all__ = ["build_env", "free_port", "launch", "main"]

if __name__ == "__main__":
    sys.exit(main())
