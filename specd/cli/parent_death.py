"""A service that `specd up` started ends with it, even when `specd up` is killed.

`specd up` starts each service in a process group of its own (a terminal's Ctrl-C reaches only
`specd up`, which then stops them in order), so a SIGKILL to `specd up` would leave its services
serving, holding their ports. It names itself in PARENT_PID_VARIABLE; a service that finds it asks
Linux to send it SIGTERM (its usual graceful stop) when that parent ends (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_PID_VARIABLE = "SPECD_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def stop_with_parent(environ=os.environ) -> bool:
    """Arrange SIGTERM for this process when the parent PARENT_PID_VARIABLE names ends; whether it
    could (not on other systems, nor without the variable). Call it from the main thread, which
    the kernel then watches the parent of."""
    parent = environ.get(PARENT_PID_VARIABLE, "")
    if not parent.isdigit() or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if os.getppid() != int(parent):  # the parent ended before the request took hold
        os.kill(os.getpid(), signal.SIGTERM)
    return True
