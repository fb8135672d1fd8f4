"""One live driver per run directory: a lease file, so two drivers with the same ``run.name`` cannot
prune each other's checkpoints or interleave their MLflow metrics.

The lease names its holder (host, pid) and is touched every ``HEARTBEAT_S`` while the run lasts.
A lease is stale, and taken over, when its holder is a dead process on this host or when it has not
been touched for ``STALE_S`` (a driver on another host that died).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path

from rayjobs.errors import ConfigError

LEASE = ".lease"
HEARTBEAT_S = 30.0
STALE_S = 120.0


class Lease:
    """The run directory's lease, held until ``release()``; ``acquire`` raises ConfigError when it is taken."""

    def __init__(self, run_dir: str) -> None:
        self.path = Path(run_dir, LEASE)
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time()}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> Lease:
        """Take the lease (or a stale one); a live holder is a one-line ConfigError naming it and the fix."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is not None and self._live(holder):
                    since = time.strftime("%H:%M:%S", time.localtime(holder.get("since", 0)))
                    raise ConfigError(
                        f"run.name: another driver (pid {holder.get('pid')} on {holder.get('host')}, since {since}) "
                        f"is running this run in {self.path.parent}; wait for it, give this run another run.name, "
                        f"or remove {self.path} if that driver is gone"
                    ) from None
                self.path.unlink(missing_ok=True)  # stale: its driver is gone
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
            self._thread = threading.Thread(target=self._beat, name="rayjobs-lease", daemon=True)
            self._thread.start()
            return self
        raise ConfigError(f"run.name: cannot take the lease {self.path}; remove it if no driver runs this run")

    def release(self) -> None:
        """Give the lease up (only if it is still ours)."""
        self._stop.set()
        holder = self._holder()
        if holder is not None and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
            try:
                self.path.unlink(missing_ok=True)
            except OSError:  # read-only storage now: the lease goes stale with this process, and is taken over
                pass

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _live(self, holder: dict) -> bool:
        try:
            age = time.time() - self.path.stat().st_mtime
        except OSError:
            return False
        if holder.get("host") == self.me["host"]:
            return _pid_alive(int(holder.get("pid", -1)))
        return age < STALE_S

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
