"""Free ports and the one supervision of started processes: wait, give a failed peer's partner its grace, stop."""

import signal
import socket
import subprocess
import sys
import time

import pytest

from splitrl.cli.fork import preforked
from splitrl.launch import PORT_RANGE_ENV, free_port, free_port_pair, supervise


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], **kwargs)


def test_a_free_port_pair_can_be_bound():
    port = free_port_pair()
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", port))
        b.bind(("127.0.0.1", port + 1))
    assert 0 < free_port() < 65536


def test_processes_that_end_by_themselves_are_left_alone():
    procs = [_python("pass"), _python("import sys; sys.exit(3)")]
    assert supervise(procs, grace=5) is True
    assert [p.returncode for p in procs] == [0, 3]


def test_a_failed_process_gives_its_partner_the_grace_then_stops_it():
    partner = _python("import time; time.sleep(60)")
    start = time.monotonic()
    assert supervise([_python("import sys; sys.exit(1)"), partner], grace=0.5) is False
    assert time.monotonic() - start < 10
    assert partner.returncode == -signal.SIGTERM


def test_timeout_stops_them_with_the_signal_asked_for():
    proc = _python("import time; time.sleep(60)")
    assert supervise([proc], grace=5, timeout=0.3, first_signal=signal.SIGINT) is False
    assert proc.returncode != 0


def test_a_process_group_is_stopped_whole():
    # The leader starts a child of its own: the signal reaches the child too, not only the leader.
    child = "import time; time.sleep(60)"
    leader = _python(
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', {child!r}]); "
        "print(p.pid, flush=True); time.sleep(60)",
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )
    child_pid = int(leader.stdout.readline())
    assert supervise([leader], grace=0.5, timeout=0.3, first_signal=signal.SIGINT, group=True) is False
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child_pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    break  # a zombie: dead, waiting for its reaper
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the leader's child survived")
    leader.stdout.close()


def test_free_ports_come_from_the_range_asked_for(monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "20000-20009")
    assert all(20000 <= free_port(count=2) <= 20008 for _ in range(20))
    monkeypatch.setenv(PORT_RANGE_ENV, "20009-20000")
    with pytest.raises(ValueError, match="LOW-HIGH"):
        free_port()


def test_forked_stages_become_the_command_they_are_sent_and_those_never_sent_one_leave_at_once(capfd):
    """`splitrl run`'s stages are forked before they know their argv: a started one runs it as the `splitrl`
    command and exits with its status; one never started exits 0 when the block ends, though a sibling forked
    after it holds no copy of its pipe (it would wait for ever)."""
    started = time.monotonic()
    from splitrl.cli import main

    with preforked(3, main) as stages:
        stages[0].start(["--version"])  # ends though stages 1 and 2, forked after it, still wait
        assert supervise(stages[:1], grace=30, timeout=30) is True
        stages[2].start(["no-such-command"])
        assert supervise(stages[2:], grace=30, timeout=30) is True
    assert [s.returncode for s in stages] == [0, 0, 2] and time.monotonic() - started < 60
    out, err = capfd.readouterr()
    assert out.count("splitrl ") == 1 and "No such command 'no-such-command'" in err
