"""The asynchronous schedules' two threads a stage: which failure ends the stage."""

import threading
import types

import pytest

from splitrl.schedule.asynchronous import _alongside, _Progress


class _Channels:
    """What `_alongside` uses of `Channels`: a link's timeout, a failure to pass on, a close."""

    def __init__(self) -> None:
        self.link = types.SimpleNamespace(timeout=5.0)
        self.failed: list[BaseException] = []
        self.closed = False

    def fail(self, exc: BaseException) -> None:
        self.failed.append(exc)

    def close(self) -> None:
        self.closed = True


def _failing_rollout(failed: threading.Event):
    def rollout() -> None:
        failed.set()
        raise RuntimeError("stage1 failed: KeyboardInterrupt: SIGINT")  # the peer's abort, as the link reports it
    return rollout


def test_a_ctrl_c_in_the_body_ends_the_stage_even_after_the_peers_abort_reached_the_rollout():
    failed, channels = threading.Event(), _Channels()
    progress = _Progress(1, 1)
    with pytest.raises(KeyboardInterrupt):
        with _alongside("test rollout", _failing_rollout(failed), progress, channels):
            assert failed.wait(5)
            progress.wait(lambda: progress.error is not None, 5, "the rollout's failure")
            raise KeyboardInterrupt  # the terminal's SIGINT, handled once the torch call returned
    assert channels.closed and isinstance(progress.error, RuntimeError)


def test_the_rollout_threads_failure_is_what_a_failing_body_reports():
    failed, channels = threading.Event(), _Channels()
    progress = _Progress(1, 1)
    with pytest.raises(RuntimeError, match="stage1 failed"):
        with _alongside("test rollout", _failing_rollout(failed), progress, channels):
            assert failed.wait(5)
            progress.wait(lambda: progress.error is not None, 5, "the rollout's failure")
            raise ValueError("the training stopped because the rollout did")
    assert channels.closed
