"""SIGTERM for a container's first process, until the server's own handlers take over.

The kernel ignores a signal that PID 1 has no handler for, so a container's SIGTERM does nothing
until the server installs its handler (wait_for_signal, once it serves). A model service loading
a checkpoint for minutes then ignored the pod's deletion, and was killed at the end of
terminationGracePeriodSeconds. Elsewhere SIGTERM's default action already ends the process.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)


def exit_on_sigterm_while_starting() -> None:
    """As PID 1, SIGTERM ends the process at once until the server's handler replaces this one,
    as its default action would elsewhere: nothing is served yet, and threads still loading
    the model would hold a normal exit."""
    if os.getpid() != 1:
        return

    def exit_now(signum, _frame) -> None:
        log.warning("%s while starting: exiting", signal.Signals(signum).name)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, exit_now)
