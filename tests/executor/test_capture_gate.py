"""executor/capture_gate.py: a CUDA graph capture never runs beside an engine step (a daemon
loading a plan while another serves); threads and events stand in for the two."""
import threading

from executor.capture_gate import CaptureGate


def _holding(section, log: list, name: str, started=None, until=None) -> None:
    """Inside `section` (a gate's step or capture): log its start, say so, wait to be let go, log its end."""
    with section():
        log.append(f"{name} starts")
        if started:
            started.set()
        if until:
            until.wait(10)
        log.append(f"{name} ends")


def test_a_capture_waits_for_the_step_under_way_and_holds_new_steps_back():
    gate, log = CaptureGate(), []
    step_running, finish_step, capture_waiting, finish_capture = (threading.Event() for _ in range(4))

    def old_engine_step(name, started=None, until=None):
        _holding(gate.step, log, name, started, until)

    def capture():
        capture_waiting.set()
        _holding(gate.capture, log, "capture", until=finish_capture)

    first = threading.Thread(target=old_engine_step, args=("step 1", step_running, finish_step))
    first.start()
    assert step_running.wait(10)
    capturing = threading.Thread(target=capture)
    capturing.start()
    assert capture_waiting.wait(10)
    second = threading.Thread(target=old_engine_step, args=("step 2",))
    while not gate._captures:  # the capture has registered: step 2 must now wait for it
        pass
    second.start()
    second.join(0.2)
    assert log == ["step 1 starts"]  # neither the capture nor step 2 began beside step 1
    finish_step.set()
    first.join(10)
    capturing.join(0.2)
    assert log == ["step 1 starts", "step 1 ends", "capture starts"]  # step 2 held back
    finish_capture.set()
    for t in (capturing, second):
        t.join(10)
    assert log == ["step 1 starts", "step 1 ends", "capture starts", "capture ends", "step 2 starts", "step 2 ends"]


def test_captures_run_one_at_a_time():
    """Two loads capturing at once (each capture synchronises the device before it records,
    which would break the other's): the second waits for the first to end."""
    gate, log = CaptureGate(), []
    first_in, finish_first = threading.Event(), threading.Event()

    def capture(name, inside=None, until=None):
        _holding(gate.capture, log, name, inside, until)

    first = threading.Thread(target=capture, args=("first", first_in, finish_first))
    first.start()
    assert first_in.wait(10)
    second = threading.Thread(target=capture, args=("second",))
    second.start()
    second.join(0.2)
    assert log == ["first starts"]
    finish_first.set()
    first.join(10)
    second.join(10)
    assert log == ["first starts", "first ends", "second starts", "second ends"]
    with gate.step():  # and steps go on after both
        pass
