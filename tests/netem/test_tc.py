"""`splitrl netem`: command construction, the netem-missing fallback, errors, and `show` in words.

Nothing here needs root: tc is replaced by a fake runner, except where a test
says it runs the real tc read-only.
"""

import itertools
import json
import shutil
import sys

import pytest
from click.testing import CliRunner

from splitrl.netem import tc
from splitrl.netem.tc import (
    NetemMissing,
    NoSuchDevice,
    NotPermitted,
    PartialShaping,
    Shaping,
    ShapingError,
    ToolMissing,
    apply_shaping,
    classify_failure,
    clear_shaping,
    describe_qdiscs,
    format_plan,
    parse_loss,
    parse_rate,
    parse_time,
    plan_shaping,
    run_command,
    show_shaping,
    tbf_sizes,
)

# Namespaces are the machine's: no other test worker makes any while this module runs (make test: several workers).
pytestmark = pytest.mark.usefixtures("netns_module")

NETEM_UNKNOWN = "Error: Specified qdisc kind is unknown."  # what tc says on a kernel without sch_netem


# -- units ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, bits", [
    ("20mbit", 20_000_000), ("500kbit", 500_000), ("1gbit", 10**9), ("1.5mbit", 1_500_000),
    ("20Mbit", 20_000_000), ("100bit", 100), ("2mbps", 16_000_000), ("1kibit", 1024), ("1mibps", 8 * 2**20),
    (" 20mbit ", 20_000_000), (".5gbit", 500_000_000),
])
def test_rates_are_read_in_tc_units(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["20", "20 furlongs", "mbit", "-1mbit", "0mbit", "", "1e3kbit"])
def test_bad_rates_are_refused_with_the_accepted_form(text):
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


@pytest.mark.parametrize("text, seconds", [("20ms", 0.02), ("500us", 0.0005), ("1s", 1.0), ("1.5msec", 0.0015), ("0ms", 0.0)])
def test_times(text, seconds):
    assert parse_time(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["20", "20min", "ms", "2h"])
def test_bad_times(text):
    with pytest.raises(ValueError, match="delay"):
        parse_time(text, "delay")


@pytest.mark.parametrize("text, percent", [("0.1%", 0.1), ("5%", 5.0), ("0.1", 0.1), ("100%", 100.0)])
def test_loss(text, percent):
    assert parse_loss(text) == pytest.approx(percent)


@pytest.mark.parametrize("text", ["101%", "-1%", "x%", "1%%"])
def test_bad_loss(text):
    with pytest.raises(ValueError, match="loss"):
        parse_loss(text)


# -- command construction: every combination ---------------------------------------------------

RATE, DELAY, JITTER, LOSS, LIMIT = "20mbit", "20ms", "5ms", "0.1%", 500
COMBOS = list(itertools.product([None, RATE], [None, DELAY], [None, JITTER], [None, LOSS], [None, LIMIT], [None, "lab-ns"]))


def _expected(rate, delay, jitter, loss, limit, netns):
    """The commands, written out independently of the code under test."""
    prefix = ["tc"] + (["-n", netns] if netns else []) + ["qdisc", "replace", "dev", "eth0", "root"]
    netem = ["netem"]
    if delay:
        netem += ["delay", "20ms"] + (["5ms"] if jitter else [])
    if loss:
        netem += ["loss", "random", "0.1%"]
    if rate:
        netem += ["rate", "20mbit"]
    # default limit: one 1 MiB message + rate x (delay + jitter) in flight, in 1448-byte segments, >= 1000
    in_flight = (20e6 if rate else 1e9) / 8 * ((0.02 if delay else 0) + (0.005 if jitter else 0))
    netem += ["limit", str(limit or max(1000, -(-(1048576 + int(in_flight)) // 1448)))]
    tbf = []
    if rate:
        burst = 32768  # 20 Mbit/s / 100 Hz = 25 kB < the 32 KiB floor
        queue = limit * 1514 if limit else 1048576 + burst
        tbf = [prefix + ["tbf", "rate", "20mbit", "burst", str(burst), "limit", str(queue)]]
    return [prefix + netem], tbf


@pytest.mark.parametrize("rate, delay, jitter, loss, limit, netns", COMBOS)
def test_commands_for_every_option_combination(rate, delay, jitter, loss, limit, netns):
    invalid = (jitter and not delay) or not (rate or delay or loss)
    if invalid:
        with pytest.raises(ValueError, match="jitter needs a delay|nothing to apply"):
            plan_shaping("eth0", Shaping.parse(rate, delay, jitter, loss, limit), netns)
        return
    plan = plan_shaping("eth0", Shaping.parse(rate, delay, jitter, loss, limit), netns)
    netem, tbf = _expected(rate, delay, jitter, loss, limit, netns)
    assert plan.netem == netem
    assert plan.tbf == tbf
    lost = [w for w, on in (("delay 20 ms", delay), ("jitter 5 ms", jitter), ("loss 0.1 %", loss)) if on]
    assert list(plan.tbf_cannot) == lost
    text = format_plan(plan)
    assert ("root netem" in text) and ("root tbf" in text) == bool(rate)


def test_the_full_netem_command_literally():
    plan = plan_shaping("eth0", Shaping.parse("20mbit", "20ms", "5ms", "0.1%"))
    assert plan.netem == [["tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay", "20ms", "5ms",
                           "loss", "random", "0.1%", "rate", "20mbit", "limit", "1000"]]
    assert plan.tbf == [["tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", "20mbit", "burst", "32768",
                         "limit", "1081344"]]


def test_netem_queue_grows_with_the_bandwidth_delay_product():
    # 1 Gbit/s x 100 ms = 12.5 MB in flight + 1 MiB, in 1448-byte segments
    plan = plan_shaping("eth0", Shaping.parse("1gbit", "100ms"))
    assert plan.netem[0][-2:] == ["limit", str(-(-(1048576 + 12_500_000) // 1448))]


def test_tbf_burst_follows_the_rate_above_the_floor():
    assert tbf_sizes(20_000_000) == (32768, 1048576 + 32768)
    burst, limit = tbf_sizes(10**9)  # 125 MB/s / 100 Hz
    assert burst == 1_250_000 and limit == 1048576 + 1_250_000
    assert tbf_sizes(8_000) == (32768, 1048576 + 32768)  # the floor also covers two full frames
    assert tbf_sizes(20_000_000, limit_packets=100) == (32768, 151400)


def test_odd_rates_and_times_stay_exact():
    plan = plan_shaping("eth0", Shaping.parse("1.5mbit", "0.25ms"))
    assert plan.netem[0][7:] == ["delay", "250us", "rate", "1500kbit", "limit", "1000"]
    assert plan_shaping("eth0", Shaping.parse("12345bit")).tbf[0][7:9] == ["rate", "12345bit"]


def test_a_small_explicit_queue_is_noted():
    plan = plan_shaping("eth0", Shaping.parse("20mbit", limit=10))
    assert any("less than one 1 MiB message" in n for n in plan.notes)


@pytest.mark.parametrize("dev", ["", "a/b", " eth0"])
def test_bad_interface_names(dev):
    with pytest.raises(ValueError, match="interface name"):
        plan_shaping(dev, Shaping.parse("20mbit"))


# -- apply: netem where present, the tbf fallback where not ----------------------------------


class FakeTc:
    """Records commands; fails netem like a kernel without sch_netem when told to."""

    def __init__(self, netem: bool, show: list | None = None) -> None:
        self.netem = netem
        self.calls: list[list[str]] = []
        self.show = show if show is not None else [{"kind": "noqueue", "handle": "0:", "root": True, "options": {}}]

    def __call__(self, argv):
        argv = list(argv)
        self.calls.append(argv)
        if "netem" in argv and not self.netem:
            raise classify_failure(argv, NETEM_UNKNOWN)
        if "show" in argv:
            return json.dumps(self.show)
        if "del" in argv:
            self.show = [{"kind": "noqueue", "handle": "0:", "root": True, "options": {}}]
        return ""


def test_netem_is_used_where_the_kernel_has_it():
    fake = FakeTc(netem=True)
    applied = apply_shaping(plan_shaping("eth0", Shaping.parse("20mbit", "20ms", "5ms", "0.1%")), run=fake)
    assert applied.qdisc == "netem" and not applied.not_applied
    assert [c[6] for c in fake.calls] == ["netem"]
    assert applied.summary() == "eth0: rate 20 Mbit/s, delay 20 ms, jitter 5 ms, loss 0.1 % via netem"


def test_rate_only_falls_back_to_tbf_with_a_note():
    fake = FakeTc(netem=False)
    applied = apply_shaping(plan_shaping("eth0", Shaping.parse("20mbit")), run=fake)
    assert [c[6] for c in fake.calls] == ["netem", "tbf"]
    assert applied.qdisc == "tbf" and not applied.not_applied
    assert any("no netem" in n for n in applied.notes)


def test_delay_without_netem_is_refused_and_nothing_changes():
    fake = FakeTc(netem=False)
    with pytest.raises(PartialShaping) as err:
        apply_shaping(plan_shaping("eth0", Shaping.parse("20mbit", "20ms", "5ms", "0.1%")), run=fake)
    message = str(err.value)
    for what in ("delay 20 ms", "jitter 5 ms", "loss 0.1 %", "--allow-partial", "nothing was changed"):
        assert what in message
    assert [c[6] for c in fake.calls] == ["netem"]  # the failed netem attempt only: tbf not applied


def test_allow_partial_applies_the_rate_and_says_what_is_missing():
    fake = FakeTc(netem=False)
    applied = apply_shaping(plan_shaping("eth0", Shaping.parse("20mbit", "20ms", loss="1%")), allow_partial=True, run=fake)
    assert applied.qdisc == "tbf"
    assert applied.not_applied == ("delay 20 ms", "loss 1 %")
    assert "NOT applied" in applied.summary() and "delay 20 ms" in applied.summary()


def test_without_netem_and_without_rate_nothing_can_be_applied():
    fake = FakeTc(netem=False)
    with pytest.raises(NetemMissing, match="without --rate"):
        apply_shaping(plan_shaping("eth0", Shaping.parse(delay="20ms")), allow_partial=True, run=fake)
    assert len(fake.calls) == 1


def test_other_failures_are_not_mistaken_for_a_missing_netem():
    def denied(argv):
        raise classify_failure(argv, "RTNETLINK answers: Operation not permitted")

    with pytest.raises(NotPermitted, match="root or the CAP_NET_ADMIN"):
        apply_shaping(plan_shaping("eth0", Shaping.parse("20mbit")), run=denied)


# -- errors ------------------------------------------------------------------------------------


def test_error_classification():
    argv = ["tc", "qdisc", "replace", "dev", "eth9", "root", "tbf"]
    assert isinstance(classify_failure(argv, NETEM_UNKNOWN), NetemMissing)
    err = classify_failure(argv, 'Cannot find device "eth9"')
    assert isinstance(err, NoSuchDevice) and "'eth9'" in str(err) and "ip link" in str(err)
    err = classify_failure(["tc", "-n", "labns"] + argv[1:], 'Cannot find device "eth9"')
    assert "namespace labns" in str(err)
    assert isinstance(classify_failure(argv, "RTNETLINK answers: Operation not permitted"), NotPermitted)
    err = classify_failure(["ip", "netns", "add", "x"], "mount --make-shared /run/netns failed: Operation not permitted")
    assert isinstance(err, NotPermitted) and "needs root or CAP_SYS_ADMIN and CAP_NET_ADMIN" in str(err)
    other = classify_failure(argv, "Error: something else")
    assert type(other) is ShapingError and "something else" in str(other) and "tc qdisc replace" in str(other)


def test_a_missing_tool_says_what_to_install():
    with pytest.raises(ToolMissing, match="iproute2"):
        run_command(["splitrl-no-such-tool-xyz", "qdisc"])


def test_a_failing_command_becomes_a_shaping_error():
    with pytest.raises(ShapingError, match="boom"):
        run_command([sys.executable, "-c", "import sys; sys.stderr.write('boom'); sys.exit(2)"])


def test_a_hanging_command_times_out():
    with pytest.raises(ShapingError, match="did not finish"):
        run_command([sys.executable, "-c", "import time; time.sleep(5)"], timeout=0.5)


@pytest.mark.skipif(shutil.which("tc") is None, reason="no tc")
def test_the_real_tc_reports_a_missing_interface():
    # read-only: `tc qdisc show` of an interface that does not exist
    with pytest.raises(NoSuchDevice, match="splitrl-nosuch"):
        show_shaping("splitrl-nosuch")


# -- show and clear ----------------------------------------------------------------------------

TBF = {"kind": "tbf", "handle": "8001:", "root": True, "refcnt": 2,
       "options": {"rate": 2500000, "burst": 32767, "lat": 419430}}  # real output of tc -j
NETEM = {"kind": "netem", "handle": "8002:", "root": True, "options": {
    "limit": 1000, "delay": {"delay": 0.02, "jitter": 0.005, "correlation": 0},
    "loss-random": {"loss": 0.001, "correlation": 0}, "rate": {"rate": 2500000, "packetoverhead": 0}, "ecn": False, "gap": 0}}


def test_show_describes_tbf_in_words():
    text = describe_qdiscs("eth0", [TBF])
    assert text == "eth0: rate 20 Mbit/s via tbf, burst 32 KiB, queue limit 1.031 MiB (419.4 ms at the rate)"


def test_show_describes_netem_in_words():
    text = describe_qdiscs("eth0", [NETEM])
    assert text == "eth0: via netem: rate 20 Mbit/s, delay 20 ms ± 5 ms, loss 0.1 %, queue limit 1000 packets"


@pytest.mark.parametrize("qdiscs, words", [
    ([{"kind": "noqueue", "handle": "0:", "root": True, "options": {}}], "no shaping (default qdisc noqueue)"),
    ([{"kind": "pfifo_fast", "handle": "0:", "root": True, "options": {"bands": 3}}], "no shaping (default qdisc pfifo_fast)"),
    ([{"kind": "mq", "handle": "0:", "root": True, "options": {}},
      {"kind": "fq_codel", "handle": "0:", "parent": ":1", "options": {}}],
     "no shaping (default qdisc mq with fq_codel per queue)"),
])
def test_show_says_when_nothing_is_shaped(qdiscs, words):
    assert describe_qdiscs("eth0", qdiscs) == f"eth0: {words}"


def test_show_names_a_foreign_qdisc():
    text = describe_qdiscs("eth0", [{"kind": "htb", "handle": "1:", "root": True, "options": {"r2q": 10}}])
    assert text == "eth0: qdisc htb (r2q 10) (not installed by splitrl netem)"


def test_clear_removes_what_apply_installed():
    fake = FakeTc(netem=False, show=[TBF])
    text = clear_shaping("eth0", run=fake)
    assert text.startswith("removed: rate 20 Mbit/s via tbf") and "no shaping" in text
    assert ["tc", "qdisc", "del", "dev", "eth0", "root"] in fake.calls


def test_clear_with_nothing_in_place_changes_nothing():
    fake = FakeTc(netem=False)
    assert clear_shaping("eth0", run=fake).startswith("nothing to clear: eth0: no shaping")
    assert not any("del" in c for c in fake.calls)


def test_clear_leaves_a_foreign_qdisc_alone():
    fake = FakeTc(netem=False, show=[{"kind": "htb", "handle": "1:", "root": True, "options": {}}])
    with pytest.raises(ShapingError, match="htb, which splitrl netem does not install"):
        clear_shaping("eth0", netns="ns", run=fake)
    assert not any("del" in c for c in fake.calls)


# -- the commands ------------------------------------------------------------------------------


def test_dry_run_prints_both_plans(cli):
    result = CliRunner().invoke(cli, ["netem", "apply", "--dev", "eth0", "--rate", "20mbit", "--delay", "20ms",
                                      "--jitter", "5ms", "--loss", "0.1%", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "tc qdisc replace dev eth0 root netem delay 20ms 5ms loss random 0.1% rate 20mbit limit 1000" in result.output
    assert "tc qdisc replace dev eth0 root tbf rate 20mbit burst 32768 limit 1081344" in result.output
    assert "not applied: delay 20 ms, jitter 5 ms, loss 0.1 %" in result.output


def test_clear_dry_run(cli):
    result = CliRunner().invoke(cli, ["netem", "clear", "--dev", "eth0", "--netns", "x", "--dry-run"])
    assert result.exit_code == 0 and result.output.strip() == "tc -n x qdisc del dev eth0 root"


@pytest.mark.parametrize("args, message", [
    (["--rate", "20"], "expected a number and a tc unit"),
    (["--jitter", "5ms"], "jitter needs a delay"),
    ([], "nothing to apply"),
    (["--rate", "20mbit", "--limit", "0"], "0"),
])
def test_bad_options_are_usage_errors(cli, args, message):
    result = CliRunner().invoke(cli, ["netem", "apply", "--dev", "eth0", "--dry-run", *args])
    assert result.exit_code == 2 and message in result.output


def test_apply_reports_errors_in_one_line(cli, monkeypatch):
    def no_tc(argv, timeout=15.0):
        raise ToolMissing("'tc' not found: it comes with iproute2")

    monkeypatch.setattr(tc, "run_command", no_tc)
    result = CliRunner().invoke(cli, ["netem", "apply", "--dev", "eth0", "--rate", "20mbit"])
    assert result.exit_code == 1
    assert result.output.strip() == "error: 'tc' not found: it comes with iproute2"


def test_apply_warns_about_what_the_fallback_leaves_out(cli, monkeypatch):
    monkeypatch.setattr(tc, "run_command", FakeTc(netem=False))
    result = CliRunner().invoke(cli, ["netem", "apply", "--dev", "eth0", "--rate", "20mbit", "--delay", "20ms"])
    assert result.exit_code == 1 and "--allow-partial" in result.output
    result = CliRunner().invoke(cli, ["netem", "apply", "--dev", "eth0", "--rate", "20mbit", "--delay", "20ms",
                                      "--allow-partial"])
    assert result.exit_code == 0, result.output
    assert "shaped eth0: rate 20 Mbit/s via tbf" in result.output
    assert "warning: not applied: delay 20 ms" in result.output
