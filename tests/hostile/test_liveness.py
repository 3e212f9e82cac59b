"""A peer that dies or goes silent is noticed within --heartbeat seconds, not at --timeout."""

from __future__ import annotations

import signal

import pytest

from splitrl.launch import free_port_pair

from .conftest import SETTINGS


# A stopped process (SIGSTOP) is a host gone silent: its kernel keeps the TCP connection, only the heartbeat
# notices. The TCP transport is not shown silent: keepalive probes are answered by a stopped process's kernel,
# so only a lost host is noticed, which loopback cannot show.
@pytest.mark.parametrize("victim, how, transport", [
    ("stage0", "SIGSTOP", "zmq"), ("stage1", "SIGSTOP", "zmq"), ("stage0", "SIGKILL", "zmq"), ("stage1", "SIGKILL", "tcp")])
def test_a_silent_or_dead_peer_is_noticed_by_heartbeat(spawn, tmp_path, victim, how, transport):
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    # --timeout far above what the test waits: only the heartbeat can end it in time.
    args = [*SETTINGS.to_argv(), "--total-steps", "4096", "--num-steps", "2048", "--threads", "1",
            "--timeout", "600", "--start-timeout", "120", "--heartbeat", "2", "--transport", transport]
    procs = {"stage1": spawn("stage1", "--bind", endpoint, "--run-dir", str(tmp_path / "s1"), *args)}
    procs["stage0"] = spawn("stage0", "--connect", endpoint, "--run-dir", str(tmp_path / "s0"), *args)
    procs["stage1"].wait_for("stage0 connected", timeout=120)
    procs[victim].popen.send_signal(getattr(signal, how))
    survivor = procs["stage1" if victim == "stage0" else "stage0"]
    code, out = survivor.finish(timeout=120)  # far below --timeout 600
    assert code == 1, out
    assert "is gone" in out or "closed the connection" in out, out


def test_a_long_wait_says_what_it_waits_for(spawn, tmp_path):
    endpoint = f"tcp://127.0.0.1:{free_port_pair()}"
    stage0 = spawn("stage0", "--connect", endpoint, "--run-dir", str(tmp_path), *SETTINGS.to_argv(),
                   "--threads", "1", "--start-timeout", "12")
    code, out = stage0.finish(timeout=120)
    assert code == 1 and "no message from stage1" in out
    assert f"waiting for stage1 at {endpoint}: 5 s so far (giving up after 12 s)" in out, out
