"""Network namespaces: the lab's names and commands, a lab that always goes away, and tc on this kernel.

The first tests need nothing special; the others need root and working ``ip netns``
(skipped otherwise) and check that no ``splitrl-`` namespace is left.
"""

import secrets
import shutil
import subprocess
import sys

import pytest

from splitrl.netem.netns import (
    STAGE0_ADDR,
    STAGE1_ADDR,
    Lab,
    LabNames,
    LoopbackNamespace,
    format_lab_plan,
    netns_available,
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

from .support import ip_netns_list, needs_netns

# Namespaces are the machine's: no other test worker makes any while this module runs (make test: several workers).
pytestmark = pytest.mark.usefixtures("netns_module")

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


def test_plan_lists_setup_shaping_commands_and_teardown():
    names = LabNames("abc123")
    plan = format_lab_plan(names, Shaping.parse("20mbit"), {"stage1": ["sleep", "1"]}).splitlines()
    assert plan[1] == "ip netns add splitrl-s1-abc123"
    assert "ip netns exec splitrl-s1-abc123 sleep 1" in plan
    assert plan[-1] == "ip netns delete splitrl-s0-abc123"


# -- root and ip netns ---------------------------------------------------------------------------


@needs_netns
def test_lab_is_removed_when_its_user_fails(no_leftovers):
    names = LabNames.random()
    no_leftovers.extend(names.namespaces)
    with pytest.raises(RuntimeError, match="boom"):
        with Lab(Shaping.parse("20mbit"), names=names) as lab:
            sleeper = lab.spawn("stage0", ["sleep", "60"])
            assert set(names.namespaces) <= set(ip_netns_list())
            raise RuntimeError("boom")
    assert sleeper.poll() is not None
    assert not set(names.namespaces) & set(ip_netns_list())


@needs_netns
def test_a_loopback_namespace_counts_its_own_traffic_and_goes_away(no_leftovers):
    assert netns_available()
    with LoopbackNamespace() as ns:
        no_leftovers.append(ns.name)
        before = ns.lo_bytes()
        knock = "import socket; socket.socket().connect_ex(('127.0.0.1', 9))"  # a SYN and a RST on its lo
        subprocess.run(ns.wrap([sys.executable, "-c", knock]), check=True, timeout=15)
        assert ns.lo_bytes() > before
    assert ns.name not in ip_netns_list()


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
    except PartialShaping as exc:  # a kernel without netem: refused, and nothing changed
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
