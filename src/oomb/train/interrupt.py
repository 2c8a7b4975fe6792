"""Preemption: SIGTERM (a scheduler's) or SIGINT (Ctrl-C) stops a run at a clean point.

The first signal is only noted: the trainer abandons the step in progress at its next chunk
boundary (one process), or all ranks finish the step and agree to stop (torch.distributed: one
collective a step), then writes a checkpoint of the last finished step and exits with 128 + the
signal's number (143 for SIGTERM). A second signal exits at once; checkpoints are written to a
temporary directory and renamed, so none is ever half-written.
"""
from __future__ import annotations

import os
import signal
import sys
import threading


class StepAbandoned(Exception):
    """Raised inside a step (from the engine's progress callback) when a signal asks to stop."""


class TrainingStopped(Exception):
    """The run stopped itself (e.g. too many non-finite steps in a row), after a checkpoint."""


class Interrupt:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, announce: bool = True) -> None:
        self.signum: int | None = None
        self.announce = announce
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second signal: no more waiting
            os._exit(128 + signum)
        self.signum = signum
        if self.announce:
            print(f"\noomb train: {signal.Signals(signum).name} received: stopping at the next clean point and "
                  "writing a checkpoint (send it again to exit at once)", file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
