"""The lease keeper: a small process that gives a read lease back for the process holding it, when that process is
waiting on its own lease.

A read lease (`leased`) holds a writer until the holder's watcher thread has copied the mapped bytes. The watcher is
Python, so it needs the interpreter's lock; a thread of the holder that writes the leased file while keeping that lock
(`torch.save` over the model's own checkpoint: its open is C++ that keeps the lock) waits for the watcher while the
watcher waits for it, until the kernel's lease-break time (45 s by default) ends the lease. The keeper, another
process with a copy of each leased descriptor (a lease belongs to the open file, so either copy gives it back), ends
that circle sooner: a lease broken for `GRACE` seconds that the holder has not taken up, while one of the holder's
own threads sleeps in the kernel's lease break (`/proc/<pid>/task/*/wchan`), is given back at once. The writer goes
on, the file changes under the mapping, and the holder's checks turn its next forward into a `CheckpointError`. In
every other case (another process writing, the holder stopped or busy) the keeper does nothing: the watcher copies as
before, or the break time runs out as before.

This module is the keeper's side, run as a script (`python -I -S`): the standard library's lightest modules only, so
that starting it costs the holder's load as little as can be (about 10 ms of another CPU). The holder's side is
`leased._Keeper`.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
import time

try:
    import fcntl
except ImportError:  # Windows: no leases, so no keeper
    fcntl = None

GRACE = 0.5
"""Seconds a broken lease waits for the holder's watcher (which looks every 20 ms) before the keeper gives it back."""
POLL_SECONDS = 0.02
MESSAGE = struct.Struct("<?i")
"""(keep, the holder's descriptor): keep it (the descriptor comes with the message), or forget it."""


def serve(holder: int, channel: socket.socket) -> None:
    """Keep the descriptors the holder sends until it forgets them, giving back a broken one the holder is stuck on;
    return when the holder is gone (its end of the channel closed)."""
    held: dict[int, list] = {}  # the holder's descriptor -> [our copy, when it was first seen broken or None]
    while True:
        readable, _, _ = select.select([channel], [], [], POLL_SECONDS if held else None)
        if readable:
            try:
                message, descriptors, _, _ = socket.recv_fds(channel, MESSAGE.size, 1)
            except OSError:
                return
            if not message:
                return
            keep, token = MESSAGE.unpack(message)
            if token in held:
                os.close(held.pop(token)[0])
            if keep and descriptors:
                held[token] = [descriptors[0], None]
        now = time.monotonic()
        for token, lease in list(held.items()):
            if not _broken(lease[0]):
                lease[1] = None
            elif lease[1] is None:
                lease[1] = now
            elif now - lease[1] >= GRACE and _waiting_on_a_lease(holder):
                give_back(lease[0])
                del held[token]


def _broken(descriptor: int) -> bool:
    """A writer waits on the lease (or it is gone already): the kernel says what it will become, not a read lease."""
    try:
        return fcntl.fcntl(descriptor, fcntl.F_GETLEASE) != fcntl.F_RDLCK
    except OSError:
        return True


def _waiting_on_a_lease(holder: int) -> bool:
    """Whether a thread of `holder` sleeps in the kernel's lease break (its wait channel): waiting on a lease, which
    its own watcher cannot give back while that thread keeps the interpreter's lock."""
    try:
        threads = os.listdir(f"/proc/{holder}/task")
    except OSError:
        return False
    for thread in threads:
        try:
            with open(f"/proc/{holder}/task/{thread}/wchan") as channel:
                if "break_lease" in channel.read():
                    return True
        except OSError:
            continue
    return False


def give_back(descriptor: int) -> None:
    """Give the lease on `descriptor` back and close it (the holder's own release too)."""
    try:
        fcntl.fcntl(descriptor, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError:  # the kernel took it back already: its break time ran out
        pass
    finally:
        os.close(descriptor)


if __name__ == "__main__":
    serve(int(sys.argv[1]), socket.socket(fileno=int(sys.argv[2])))
