"""`splitrl lab`: both stages in the two-namespace lab, the throughput, and the byte accounting.

The first half needs nothing special. The second half needs root and working
``ip netns`` (skipped otherwise): one lab at 20 Mbit/s runs the tiny training
once (module fixture) and several tests read its result; the others check that
the lab disappears when a stage fails and on Ctrl-C. Every namespace is removed
in teardown, and the last test of each fixture checks that no ``splitrl-``
namespace is left.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from click.testing import CliRunner

from splitrl.lab import LabResult, SideBytes, app_bytes_from_metrics, format_report, run_lab
from splitrl.cli.netem import lab as lab_command
from splitrl.netem.netns import STAGE1_ADDR, LabNames
from splitrl.netem.tc import Shaping

from ..conftest import TINY, child_env
from ..netem.support import ip_netns_list, needs_netns, remove_namespaces

# Namespaces are the machine's: no other test worker makes any while this module runs (make test: several workers).
pytestmark = pytest.mark.usefixtures("netns_module")

# -- no root needed ------------------------------------------------------------------------------


def _metrics(tmp_path, record):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"iteration": 1}) + "\n" + json.dumps(record) + "\n")


def test_app_bytes_come_from_stage0s_meter_plus_its_close(tmp_path):
    _metrics(tmp_path, {
        "iteration": 2,
        "net_total/hello/sent_bytes": 694, "net_total/hello/sent_messages": 1,
        "net_total/step/sent_bytes": 1000, "net_total/step/sent_messages": 9,
        "net_total/hello/recv_bytes": 694, "net_total/hello/recv_messages": 1,
        "net_total/action/recv_bytes": 300, "net_total/action/recv_messages": 9,
        "net/step/sent_bytes": 500,  # per-iteration keys are not totals
    })
    close = len(msgpack.packb({"v": 1, "k": "close", "s": 10, "h": {}, "t": []}, use_bin_type=True))
    assert app_bytes_from_metrics(tmp_path) == {"stage0": (1694 + close, 11), "stage1": (994, 10)}


def test_report_shows_raw_and_header_corrected_ratios():
    sides = [
        SideBytes("stage0", "s0-x", 1_000_000, 100, 1_046_200, 700, 66, {"OutSegs": 700, "RetransSegs": 0}),
        SideBytes("stage1", "s1-x", 500_000, 50, 530_000, 450, 66, {}),
    ]
    assert sides[0].corrected == 1_000_000 and sides[0].corrected_ratio == 1.0
    assert sides[0].raw_ratio == pytest.approx(1.0462)
    text = format_report(LabResult(LabNames("ab"), [], None, {"stage0": 0, "stage1": 0}, "/run", sides))
    assert "| stage0 | s0-x | 1,000,000 | 1,046,200 | 700 | 46,200 | 1,000,000 | 1.0462 | 1.0000 |" in text
    assert "| stage1 | s1-x | 500,000 | 530,000 | 450 | 29,700 | 500,300 | 1.0600 | 1.0006 |" in text
    assert "Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12 = 66 B" in text
    assert "ZeroMQ's framing" in text


def test_lab_dry_run_lists_every_command(tmp_path):
    result = CliRunner().invoke(lab_command, ["--dry-run", "--run-dir", str(tmp_path / "run"), *TINY])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "ip netns add splitrl-s1-" in out and "ip netns add splitrl-s0-" in out
    assert "root tbf rate 20mbit burst 32768 limit 1081344" in out
    assert f"-m splitrl stage1 --bind tcp://{STAGE1_ADDR}:5555" in out
    assert f"-m splitrl stage0 --connect tcp://{STAGE1_ADDR}:5555" in out
    assert "--total-steps 64" in out and f"--run-dir {tmp_path / 'run'}" in out
    assert out.strip().splitlines()[-1].startswith("ip netns delete splitrl-s0-")


def test_lab_refuses_invalid_training_settings_before_creating_anything():
    result = CliRunner().invoke(lab_command, ["--num-steps", "0"])
    assert result.exit_code == 2 and "--num-steps must be >= 1" in result.output


# -- root and ip netns ---------------------------------------------------------------------------


def _host_network() -> tuple[str, str]:
    route = subprocess.run(["ip", "route"], capture_output=True, text=True, timeout=15).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=15).stdout
    return route, "\n".join(sorted(line.split(":")[1].strip() for line in links.splitlines()))


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory, netns_module, netns_ok):
    """One lab at 20 Mbit/s: throughput with 4 MiB, then the tiny training. Runs once per module."""
    run_dir = str(tmp_path_factory.mktemp("lab") / "run")
    names = LabNames.random()
    host_before = _host_network()
    lines: list[str] = []
    start = time.monotonic()
    try:
        result = run_lab([*TINY, "--run-dir", run_dir, "--timeout", "60"], run_dir, Shaping.parse("20mbit"),
                         measure_bytes=4 * 1024 * 1024, names=names, echo=lines.append)
    finally:
        remove_namespaces(names.namespaces)
    return {"result": result, "names": names, "host_before": host_before, "host_after": _host_network(),
            "namespaces_after": ip_netns_list(), "lines": lines, "seconds": time.monotonic() - start}


@needs_netns
def test_lab_trains_to_the_end(lab_run):
    result = lab_run["result"]
    assert result.codes == {"stage1": 0, "stage0": 0}, lab_run["lines"]
    rows = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert (Path(result.run_dir) / "config-stage1.json").exists()


@needs_netns
def test_a_20mbit_lab_link_delivers_15_to_21_mbit(lab_run):
    tput = lab_run["result"].throughput
    assert tput is not None
    assert 15e6 <= tput.goodput_bits <= 21e6, tput.text()
    # the wire rate (headers included) is what tbf shapes: close to 20 Mbit/s, never much above
    assert 15e6 <= tput.wire_bits <= 21e6, tput.text()


@needs_netns
def test_app_meters_agree_with_the_kernel_counters_within_3_percent(lab_run):
    sides = lab_run["result"].sides
    assert [s.side for s in sides] == ["stage0", "stage1"]
    for s in sides:
        # kernel tx_bytes minus 66 B of Ethernet/IP/TCP headers per packet (tx_packets) vs the app's meter;
        # what remains is ZeroMQ framing, SYN options, ARP and the odd retransmitted segment
        assert abs(s.corrected_ratio - 1) <= 0.03, format_report(lab_run["result"])
        # the premise of the correction: GSO is off on the veth, so a packet is a segment (+ ARP)
        assert abs(s.tx_packets - s.tcp["OutSegs"]) <= 4, s
        # and the correction matters: raw, the headers alone are about 4.6 % of a full segment
        assert s.raw_ratio > 1.03


@needs_netns
def test_lab_prints_the_throughput_and_the_accounting(lab_run):
    report = format_report(lab_run["result"])
    assert "achieved throughput stage0 -> stage1 (link shaped to rate 20 Mbit/s)" in report
    assert "(kernel - headers) / app" in report
    assert any("shaped s0-" in line for line in lab_run["lines"])


@needs_netns
def test_lab_leaves_nothing_behind(lab_run):
    assert not [ns for ns in lab_run["namespaces_after"] if ns.startswith("splitrl-")]
    assert lab_run["host_after"] == lab_run["host_before"]  # host routes and interfaces untouched


@needs_netns
def test_a_delay_works_without_netem_through_the_relay_and_the_lab_measures_it(tmp_path, no_leftovers):
    """This kernel has no netem: the rate goes to tbf and 10 ms each way to the TCP relay. The lab and the
    pipelined schedule both measure the round trip; each must see at least the 20 ms it was given."""
    names = LabNames.random()
    no_leftovers.extend(names.namespaces)
    run_dir = str(tmp_path / "run")
    lines: list[str] = []
    args = [*TINY, "--num-envs", "2", "--rollout-groups", "2", "--total-steps", "128", "--run-dir", run_dir,
            "--timeout", "60"]
    result = run_lab(args, run_dir, Shaping.parse("100mbit", "10ms"), measure_bytes=0, names=names,
                     echo=lines.append)
    assert result.codes == {"stage1": 0, "stage0": 0}, "\n".join(lines)
    assert sorted(result.round_trip)[len(result.round_trip) // 2] >= 0.020
    assert any("round trip stage0 -> stage1 -> stage0" in line and "20 ms set" in line for line in lines)
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["link/rtt_ms"] >= 20.0
    uses_relay = any("relay" in note for applied in result.applied for note in applied.notes)
    assert uses_relay or all(a.qdisc == "netem" for a in result.applied)  # a kernel with netem uses netem
    assert not set(names.namespaces) & set(ip_netns_list())


@needs_netns
def test_lab_is_removed_when_a_stage_fails(tmp_path, no_leftovers):
    names = LabNames.random()
    no_leftovers.extend(names.namespaces)
    run_dir = str(tmp_path / "run")
    result = run_lab(["--run-dir", run_dir, "--no-such-option"], run_dir, Shaping.parse("20mbit"),
                     measure_bytes=0, names=names, grace=10, echo=lambda *_: None)
    assert result.code == 2 and not result.sides
    assert not set(names.namespaces) & set(ip_netns_list())


DRIVER = "from splitrl.cli import main; main()"


@needs_netns
def test_ctrl_c_stops_both_stages_and_removes_the_lab(tmp_path, no_leftovers):
    run_dir = tmp_path / "run"
    log_path = tmp_path / "lab.log"
    args = ["lab", "--measure", "0", "--run-dir", str(run_dir), "--total-steps", "100000", "--num-steps", "32",
            "--epochs", "2", "--minibatches", "2", "--max-episode-steps", "20", "--threads", "1", "--hidden", "32"]
    with open(log_path, "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, *args], env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while "stage0 connected" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        tag = next(line.split()[1].rstrip(":") for line in log_path.read_text().splitlines() if line.startswith("lab "))
        no_leftovers.extend(LabNames(tag).namespaces)
        time.sleep(1)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = log_path.read_text()
    assert code == 130, out
    assert "interrupted: stopping both stages" in out
    assert not set(LabNames(tag).namespaces) & set(ip_netns_list())
    left = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout
    assert not [line for line in left.splitlines() if "pgrep" not in line]




def test_a_thin_lab_gives_the_stages_a_heartbeat_a_minibatch_can_cross():
    from splitrl.lab import LARGEST_MESSAGE, heartbeat_for, stage_commands

    two = heartbeat_for(2_000_000)
    assert two[0] == "--heartbeat" and 0.4 * float(two[1]) > LARGEST_MESSAGE * 8 / 2_000_000 / 0.956
    assert heartbeat_for(20_000_000) == [] and heartbeat_for(None) == []
    assert heartbeat_for(2_000_000, ["--heartbeat", "3"]) == []  # the user's own stands
    cmds = stage_commands(["--total-steps", "64"], rate_bits=2_000_000)
    assert all(cmd[cmd.index("--heartbeat") + 1] == two[1] for cmd in cmds.values())
