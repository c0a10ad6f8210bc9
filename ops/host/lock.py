"""The host side of the host lock, run by the GPU host's own python3 (standard library only).

ops starts it over its connection (`python3 -c SOURCE`) and it lives exactly as long as the ops command
that holds the lock: it takes an exclusive flock on the lock file, writes the holder record into it, and
then only waits on its stdin. It exits, and the kernel drops the flock, when ops closes its stdin (the
command ended, also after an error or Ctrl-C), when the SSH connection drops (sshd closes the pipe), or
when ops's heartbeat (a newline every few seconds) has not come for `expire` seconds (a frozen or
vanished laptop whose TCP connection still looks open). A killed keeper leaves its record behind, but
not its flock: the record is only ever read by someone who failed to take the flock.
Protocol: one JSON request line on stdin; JSON lines on stdout: `waiting` (once, with the holder),
then `held` (with our record) or `busy` (with the holder). This module must not import anything from ops.
"""

import fcntl
import json
import os
import pwd
import select
import sys
import time


def open_lock(path):
    """Open the lock file, creating it readable and writable by every operator's user (in a sticky
    folder such as /run/lock another user's file can be opened, not created over)."""
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        pass
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        os.fchmod(fd, 0o666)
        return fd
    except FileExistsError:
        return os.open(path, os.O_RDWR)


def try_lock(fd):
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def holder(fd):
    try:
        return json.loads(os.pread(fd, 65536, 0).decode() or "null")
    except ValueError:
        return None


def say(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def read_request():
    line = b""
    while not line.endswith(b"\n"):  # byte by byte: no buffered read may swallow the EOF we wait for
        ch = os.read(0, 1)
        if not ch:
            sys.exit(0)
        line += ch
    return json.loads(line)


class Lifeline:
    """ops's stdin: alive while it stays open and its heartbeat keeps coming."""

    def __init__(self, expire):
        self.expire = expire
        self.last = time.monotonic()

    def alive(self, timeout):
        ready, _, _ = select.select([0], [], [], timeout)
        if ready:
            if not os.read(0, 4096):
                return False
            self.last = time.monotonic()
        return time.monotonic() - self.last < self.expire


def main():
    req = read_request()
    life = Lifeline(float(req["expire"]))
    fd = open_lock(req["path"])
    deadline = time.monotonic() + float(req["wait"])
    waiting = False
    while not try_lock(fd):
        if time.monotonic() >= deadline:
            say({"state": "busy", "holder": holder(fd)})
            return 0
        if not waiting:
            say({"state": "waiting", "holder": holder(fd)})
            waiting = True
        if not life.alive(0.2):
            return 0
    try:
        ssh_user = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        ssh_user = str(os.getuid())
    record = dict(
        req["record"],
        ssh_user=ssh_user,
        pid=os.getpid(),
        since=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    say({"state": "held", "record": record})
    while life.alive(life.expire):
        pass
    os.ftruncate(fd, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
