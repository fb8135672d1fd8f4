"""Notice of an imminent preemption: a checkpoint is taken at once, then the process may end."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from rayjobs.context import WorkerContext
from rayjobs.log import log


class Preemption:
    """Notice of an imminent preemption: Ray's (a node being drained) or, in local mode, SIGTERM."""

    CHECK_EVERY = 10  # steps between Ray's preemption checks (each is a barrier across workers)

    def __init__(self, local_mode: bool) -> None:
        self.local_mode = local_mode
        self.sigterm = False
        self.saved = False
        if local_mode and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.sigterm = True

    def requested(self, ctx: WorkerContext, step: int) -> bool:
        """True once when a checkpoint should be taken now because of a preemption."""
        if self.saved:
            return False
        if self.local_mode:
            notice = self.sigterm
        elif step % self.CHECK_EVERY == 0:
            import ray.train

            notice = ray.train.get_preemption_info() is not None
        else:
            notice = False
        if notice:
            self.saved = True
            if ctx.is_main:
                log(f"step {step}: preemption notice: taking a checkpoint now")
        return notice

    def exit_if_requested(self, ctx: WorkerContext) -> None:
        """After the SIGTERM checkpoint (local mode), end the process the way SIGTERM would have."""
        if self.sigterm and self.saved:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
