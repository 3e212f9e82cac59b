"""`splitrl lab`: two namespaces, a shaped veth pair, both stages inside, and the byte accounting.

The first half needs nothing special. The second half needs root and working
``ip netns`` (skipped otherwise): one lab at 20 Mbit/s runs the tiny training
once (module fixture) and several tests read its result; the others check that
the lab disappears on failure and on Ctrl-C, and the netem fallback against this
kernel's real tc. Every namespace is removed in teardown, and the last test of
each fixture checks that no ``splitrl-`` namespace is left.
"""

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
from click.testing import CliRunner

from splitrl.netem.lab import (
    STAGE0_ADDR,
    STAGE1_ADDR,
    Lab,
    LabNames,
    LabResult,
    SideBytes,
    app_bytes_from_metrics,
    format_report,
    run_lab,
    setup_commands,
    teardown_commands,
)
from splitrl.netem.tc import (
    NotPermitted,
    PartialShaping,
    Shaping,
    apply_shaping,
    clear_shaping,
    plan_shaping,
    run_command,
    show_shaping,
)

from ..conftest import TINY, child_env

# -- no root needed ------------------------------------------------------------------------------


def test_names_fit_interface_limits_and_carry_the_tag():
    names = LabNames("0a1b2c")
    assert names.namespaces == ("splitrl-s1-0a1b2c", "splitrl-s0-0a1b2c")
    assert names.dev("stage0") == "s0-0a1b2c" and len(names.dev("stage1")) <= 15
    assert LabNames.random().tag != LabNames.random().tag
    with pytest.raises(ValueError):
        LabNames("not hex")


def test_setup_touches_only_the_labs_namespaces():
    names = LabNames("abc123")
    cmds = setup_commands(names)
    assert cmds[:2] == [["ip", "netns", "add", "splitrl-s1-abc123"], ["ip", "netns", "add", "splitrl-s0-abc123"]]
    # the veth pair is born inside the namespaces; every later command names a lab namespace
    assert cmds[2] == ["ip", "link", "add", "s0-abc123", "netns", "splitrl-s0-abc123", "type", "veth",
                       "peer", "name", "s1-abc123", "netns", "splitrl-s1-abc123"]
    for cmd in cmds[3:]:
        assert cmd[:2] == ["ip", "-n"] and cmd[2] in names.namespaces
    assert ["ip", "-n", "splitrl-s0-abc123", "addr", "add", f"{STAGE0_ADDR}/30", "dev", "s0-abc123"] in cmds
    assert ["ip", "-n", "splitrl-s1-abc123", "addr", "add", f"{STAGE1_ADDR}/30", "dev", "s1-abc123"] in cmds
    assert ["ip", "-n", "splitrl-s0-abc123", "link", "set", "dev", "s0-abc123",
            "addrgenmode", "none", "gso_max_segs", "1"] in cmds
    assert teardown_commands(names) == [["ip", "netns", "delete", ns] for ns in names.namespaces]


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


def test_lab_dry_run_lists_every_command(cli, tmp_path):
    result = CliRunner().invoke(cli, ["lab", "--dry-run", "--run-dir", str(tmp_path / "run"), *TINY])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "ip netns add splitrl-s1-" in out and "ip netns add splitrl-s0-" in out
    assert "root tbf rate 20mbit burst 32768 limit 1081344" in out
    assert f"-m splitrl stage1 --bind tcp://{STAGE1_ADDR}:5555" in out
    assert f"-m splitrl stage0 --connect tcp://{STAGE1_ADDR}:5555" in out
    assert "--total-steps 64" in out and f"--run-dir {tmp_path / 'run'}" in out
    assert out.strip().splitlines()[-1].startswith("ip netns delete splitrl-s0-")


def test_lab_refuses_invalid_training_settings_before_creating_anything(cli):
    result = CliRunner().invoke(cli, ["lab", "--num-steps", "0"])
    assert result.exit_code == 2 and "--num-steps must be >= 1" in result.output


# -- root and ip netns ---------------------------------------------------------------------------


def _ip_netns_list() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=15).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netns_usable() -> str | None:
    """None if namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs ip and tc (iproute2)"
    probe = f"splitrl-probe-{secrets.token_hex(3)}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=15)
        if made.returncode != 0:
            return f"ip netns add failed: {made.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True, timeout=15)
    return None


@pytest.fixture(scope="session")
def netns_ok():
    """Skip unless this process can create network namespaces (probed once, in a throwaway one)."""
    why_not = _netns_usable() if sys.platform.startswith("linux") else "Linux only"
    if why_not is not None:
        pytest.skip(f"lab tests: {why_not}")


needs_netns = pytest.mark.usefixtures("netns_ok")


def _remove(namespaces) -> None:
    for ns in namespaces:
        subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=15)


def _host_network() -> tuple[str, str]:
    route = subprocess.run(["ip", "route"], capture_output=True, text=True, timeout=15).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=15).stdout
    return route, "\n".join(sorted(line.split(":")[1].strip() for line in links.splitlines()))


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory, netns_ok):
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
        _remove(names.namespaces)
    return {"result": result, "names": names, "host_before": host_before, "host_after": _host_network(),
            "namespaces_after": _ip_netns_list(), "lines": lines, "seconds": time.monotonic() - start}


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


@pytest.fixture
def no_leftovers(netns_ok):
    """Remove this test's namespaces whatever happens, then check none is left."""
    made: list[str] = []
    yield made
    _remove(made)
    assert not [ns for ns in _ip_netns_list() if ns.startswith("splitrl-")]


@needs_netns
def test_lab_is_removed_when_its_user_fails(no_leftovers):
    names = LabNames.random()
    no_leftovers.extend(names.namespaces)
    with pytest.raises(RuntimeError, match="boom"):
        with Lab(Shaping.parse("20mbit"), names=names) as lab:
            sleeper = lab.spawn("stage0", ["sleep", "60"])
            assert set(names.namespaces) <= set(_ip_netns_list())
            raise RuntimeError("boom")
    assert sleeper.poll() is not None
    assert not set(names.namespaces) & set(_ip_netns_list())


@needs_netns
def test_lab_is_removed_when_a_stage_fails(tmp_path, no_leftovers):
    names = LabNames.random()
    no_leftovers.extend(names.namespaces)
    run_dir = str(tmp_path / "run")
    result = run_lab(["--run-dir", run_dir, "--no-such-option"], run_dir, Shaping.parse("20mbit"),
                     measure_bytes=0, names=names, grace=10, echo=lambda *_: None)
    assert result.code == 2 and not result.sides
    assert not set(names.namespaces) & set(_ip_netns_list())


DRIVER = "from splitrl.cli import main; main()"


@needs_netns
def test_ctrl_c_stops_both_stages_and_removes_the_lab(tmp_path, no_leftovers):
    run_dir = tmp_path / "run"
    log_path = tmp_path / "lab.log"
    args = ["lab", "--measure", "0", "--run-dir", str(run_dir), "--total-steps", "100000", "--num-steps", "32",
            "--epochs", "2", "--minibatches", "2", "--max-episode-steps", "20", "--threads", "1"]
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
    assert not set(LabNames(tag).namespaces) & set(_ip_netns_list())
    left = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True).stdout
    assert not [line for line in left.splitlines() if "pgrep" not in line]


@pytest.fixture
def scratch_ns(no_leftovers):
    """A throwaway namespace with only ``lo``: safe to try qdiscs in (never the host's lo)."""
    ns = f"splitrl-t-{secrets.token_hex(3)}"
    no_leftovers.append(ns)
    run_command(["ip", "netns", "add", ns])
    run_command(["ip", "-n", ns, "link", "set", "dev", "lo", "up"])
    return ns


@needs_netns
def test_netem_fallback_on_this_kernel(scratch_ns):
    shaping = Shaping.parse("20mbit", "20ms")
    plan = plan_shaping("lo", shaping, scratch_ns)
    try:
        applied = apply_shaping(plan)
    except PartialShaping as exc:  # this kernel has no netem: refused, and nothing changed
        assert "delay 20 ms cannot be applied" in str(exc)
        assert "no shaping" in show_shaping("lo", scratch_ns)
        applied = apply_shaping(plan, allow_partial=True)
        assert applied.qdisc == "tbf" and applied.not_applied == ("delay 20 ms",)
        assert show_shaping("lo", scratch_ns).startswith("lo: rate 20 Mbit/s via tbf, burst 32 KiB")
    else:  # a kernel with netem applies everything
        assert applied.qdisc == "netem"
        assert "delay 20 ms" in show_shaping("lo", scratch_ns)
    assert clear_shaping("lo", scratch_ns).startswith("removed: ")
    assert "no shaping" in show_shaping("lo", scratch_ns)


@needs_netns
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv to drop root")
def test_not_permitted_is_a_clear_error(scratch_ns):
    as_nobody = ["ip", "netns", "exec", scratch_ns, "setpriv", "--reuid=65534", "--clear-groups", "--inh-caps=-all"]
    with pytest.raises(NotPermitted, match="needs root or the CAP_NET_ADMIN"):
        run_command(as_nobody + ["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate", "1mbit",
                                 "burst", "32768", "limit", "100000"])
