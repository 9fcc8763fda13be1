"""A writable temporary directory, or a one-line refusal that says how to give one.

torch writes its caches under it as the model loads, and `kvserve up` keeps its children's private
sockets there; a container with a read-only root filesystem and nothing mounted at /tmp has none.
"""

from __future__ import annotations

import tempfile


def require_temp_dir(command: str) -> str:
    """The temporary directory; SystemExit naming the cause when no candidate is writable."""
    try:
        return tempfile.gettempdir()
    except FileNotFoundError:   # tempfile tried TMPDIR, /tmp, /var/tmp, /usr/tmp and the working directory
        raise SystemExit(f"{command}: no writable temporary directory: set TMPDIR to one, or mount one at /tmp "
                         "(with a read-only root filesystem, an emptyDir)") from None
