"""Preemption: SIGTERM (a scheduler's) or SIGINT (Ctrl-C) stops a run at a clean point.

The first signal is only noted: the trainer abandons the step in progress at the next chunk
boundary, writes a checkpoint of the last finished step and exits with 128 + the signal's number
(143 for SIGTERM). Under torch.distributed the ranks agree on that boundary: after every chunk
pass each rank all-reduces a flag (one int32 on the host, gloo) and reads the one of the pass
before, so all of them abandon the step after the same pass, even when the signal reached one
rank only. torchrun sends SIGKILL 30 s after it forwards SIGTERM: `shutdown_timeout_s`
(--shutdown-timeout, 25 s) is the time the stop gets. The run says once, from its measured chunk
pass and checkpoint times, when a stop could take longer; and when the time is up before the
checkpoint is written, it says so and exits without it. A second signal exits at once;
checkpoints are written to a temporary directory and renamed, so none is ever half-written.
"""
from __future__ import annotations

import os
import signal
import sys
import threading

import torch
import torch.distributed as dist


class StepAbandoned(Exception):
    """Raised inside a step (from the engine's progress callback) when the ranks agree to stop."""


class TrainingStopped(Exception):
    """The run stopped itself (e.g. too many non-finite steps in a row), after a checkpoint."""


class Interrupt:
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, announce: bool = True, shutdown_timeout_s: float = 0.0) -> None:
        self.signum: int | None = None
        self.announce = announce
        self.shutdown_timeout_s = shutdown_timeout_s  # 0: no limit
        self.newest_checkpoint = ""  # named when the time is up
        self._deadline: threading.Timer | None = None
        self._warned = False
        self._pending = None  # the flag's all-reduce sent at the last agreed()
        self._previous = {}
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # the second signal: no more waiting
            os._exit(128 + signum)
        self.signum = signum
        if self.shutdown_timeout_s:
            self._deadline = threading.Timer(self.shutdown_timeout_s, self._time_is_up)
            self._deadline.daemon = True
            self._deadline.start()
        if self.announce:
            print(f"\noomb train: {signal.Signals(signum).name} received: stopping at the next clean point and "
                  "writing a checkpoint (send it again to exit at once)", file=sys.stderr, flush=True)

    def _time_is_up(self) -> None:
        if self.announce:
            newest = (f"the newest checkpoint is {self.newest_checkpoint}" if self.newest_checkpoint
                      else "this run wrote no checkpoint")
            print(f"oomb train: {self.name} {self.shutdown_timeout_s:g} s ago and the checkpoint is not written "
                  f"(--shutdown-timeout): exiting without it; {newest}", file=sys.stderr, flush=True)
        os._exit(self.exit_code())

    def agreed(self, group=None) -> bool:
        """Whether to stop now: a signal here, or under torch.distributed on any rank, agreed by an
        all-reduce of a host flag over `group` (gloo: host_group()). The flag sent at one call is
        read at the next, so that ranks up to a call apart do not wait for each other: every rank
        gets the same answer at the same call, one call after the signal."""
        if not dist.is_initialized():
            return self.requested
        sent = torch.tensor([int(self.requested)], dtype=torch.int32)
        pending, self._pending = self._pending, (dist.all_reduce(sent, op=dist.ReduceOp.MAX, group=group,
                                                                 async_op=True), sent)
        if pending is None:
            return False
        pending[0].wait()
        stop = bool(pending[1].item())
        if stop and not self.requested:  # another rank's signal: stop with it
            self.signum = signal.SIGTERM
        return stop

    def check_time(self, pass_s: float, passes: int, save_s: float) -> None:
        """Says once when a stop could outlast shutdown_timeout_s: `passes` chunk passes of pass_s
        (the one in progress, the next, as agreed() reads the flag a pass late, and those queued
        ahead of the GPU) and a checkpoint of save_s."""
        stop_s = passes * pass_s + save_s
        if self._warned or not self.shutdown_timeout_s or stop_s <= self.shutdown_timeout_s:
            return
        self._warned = True
        if self.announce:
            print(f"oomb train: warning: a stop on SIGTERM could take {stop_s:.0f} s here ({passes} chunk passes of "
                  f"{pass_s:.1f} s, a checkpoint of {save_s:.0f} s), more than --shutdown-timeout "
                  f"{self.shutdown_timeout_s:g}: a preempted run would exit without its checkpoint. Give the stop "
                  "more time (torchrun --shutdown-timeout, 30 s by default, and oomb train --shutdown-timeout a "
                  "little less) or take a smaller --chunk-size", file=sys.stderr, flush=True)

    def disarm(self) -> None:
        """The stop is done (checkpoint written): the time limit no longer applies."""
        if self._deadline is not None:
            self._deadline.cancel()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def settle(self) -> None:
        """Waits for the flag's last all-reduce (every rank sent it at the same call): a process
        group destroyed under a pending operation aborts the process."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
