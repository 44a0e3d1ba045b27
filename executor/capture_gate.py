"""One CUDA graph capture at a time, and no engine step beside it.

A daemon loads a new plan while the old one serves: the new plan's decode graphs are captured on
the loading thread while the old engine steps on its own. CUDA forbids synchronising the device
(or a stream the capture depends on) while a stream captures: the old engine's
`torch.cuda.synchronize` (freeing a finished sequence's pinned pages, the lost-device check)
would fail its step and invalidate the capture, and a failed capture fails the load. So each
capture waits for the steps under way to end and holds new ones back until it is done
(milliseconds a bucket: a warm-up step on the capture stream and the capture; the warm-up that
compiles runs before, outside the gate).
"""
from __future__ import annotations

import contextlib
import threading


class CaptureGate:
    def __init__(self):
        self._cond = threading.Condition()
        self._steps = 0  # engine steps under way
        self._captures = 0  # captures under way or waiting (a waiting one holds new steps back)
        self._capturing = False  # one under way: another waits for it (the one under way synchronises)

    @contextlib.contextmanager
    def step(self):
        """Around an engine's device work (its step, an abort's frees)."""
        with self._cond:
            while self._captures:
                self._cond.wait()
            self._steps += 1
        try:
            yield
        finally:
            with self._cond:
                self._steps -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def capture(self):
        """Around one CUDA graph capture (never inside a step: it would wait for itself), and one
        at a time: a capture synchronises the device before it records, which would break
        another's under way."""
        with self._cond:
            self._captures += 1
            while self._steps or self._capturing:
                self._cond.wait()
            self._capturing = True
        try:
            yield
        finally:
            with self._cond:
                self._capturing = False
                self._captures -= 1
                self._cond.notify_all()


GATE = CaptureGate()  # one per process: captures and steps of every model in it
