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

Standard library only: the holder runs this file as a script (`python -I -S`), so starting it imports nothing.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref

try:
    import fcntl
except ImportError:  # Windows: no leases, so no keeper
    fcntl = None

_log = logging.getLogger("streamwise.load")

GRACE = 0.5
"""Seconds a broken lease waits for the holder's watcher (which looks every 20 ms) before the keeper gives it back."""
POLL_SECONDS = 0.02
_MESSAGE = struct.Struct("<?i")
"""(keep, the holder's descriptor): keep it (the descriptor comes with the message), or forget it."""


class Keeper:
    """The holder's side: starts the keeper at the first lease and tells it which leases to keep and forget. A
    keeper that cannot start or has gone is a debug line and nothing more: the watcher alone was the design before."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channel: socket.socket | None = None
        self._process: subprocess.Popen | None = None
        self._owner: int | None = None
        """The process that started the keeper: a process forked from it does not speak to it."""

    def keep(self, descriptor: int) -> None:
        with self._lock:
            if self._owner is None:
                self._start()
            self._send(True, descriptor)

    def forget(self, descriptor: int) -> None:
        """The holder gives the lease back itself (or copies first): the keeper lets go of its copy."""
        with self._lock:
            self._send(False, descriptor)

    def _start(self) -> None:
        self._owner = os.getpid()
        if "python" not in os.path.basename(sys.executable or "").lower():  # embedded: running it might be an app
            _log.debug("streamwise: no lease keeper: %r is not a Python interpreter to run it with", sys.executable)
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-I", "-S", __file__, str(self._owner), str(theirs.fileno())],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)  # no terminal signal (Ctrl-C, Ctrl-Z) reaches it: it ends with its holder
        except (OSError, ValueError) as exc:
            _log.debug("streamwise: no lease keeper (%s): a write by this process's own thread that keeps the "
                       "interpreter's lock waits out the lease-break time", exc)
            ours.close()
        else:
            self._channel = ours
            weakref.finalize(self, _stop, self._owner, ours, self._process)  # at exit too: no keeper left behind
        finally:
            theirs.close()

    def _send(self, keep: bool, descriptor: int) -> None:
        if self._channel is None or os.getpid() != self._owner:
            return
        try:
            socket.send_fds(self._channel, [_MESSAGE.pack(keep, descriptor)], [descriptor] if keep else [],
                            socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError as exc:  # gone, or not reading: never block the holder on it
            _log.debug("streamwise: the lease keeper is gone (%s)", exc)
            self._channel.close()
            self._channel = None


def _stop(owner: int, channel: socket.socket, process: subprocess.Popen) -> None:
    """Close the channel, which ends the keeper, and reap it."""
    channel.close()
    if os.getpid() == owner:
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def serve(holder: int, channel: socket.socket) -> None:
    """Keep the descriptors the holder sends until it forgets them, giving back a broken one the holder is stuck on;
    return when the holder is gone (its end of the channel closed)."""
    held: dict[int, list] = {}  # the holder's descriptor -> [our copy, when it was first seen broken or None]
    while True:
        readable, _, _ = select.select([channel], [], [], POLL_SECONDS if held else None)
        if readable:
            try:
                message, descriptors, _, _ = socket.recv_fds(channel, _MESSAGE.size, 1)
            except OSError:
                return
            if not message:
                return
            keep, token = _MESSAGE.unpack(message)
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
                _give_back(lease[0])
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


def _give_back(descriptor: int) -> None:
    try:
        fcntl.fcntl(descriptor, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    except OSError:  # the kernel took it back already
        pass
    finally:
        os.close(descriptor)


if __name__ == "__main__":
    serve(int(sys.argv[1]), socket.socket(fileno=int(sys.argv[2])))
