"""Who is in a fleet: edges that die are dropped, edges whose messages do not fit are turned away at the door,
edges that come back rejoin, a resumed fleet starts where every edge can (`splitrl.schedule.roster`)."""

import re
import time

import numpy as np
import pytest
import torch

from splitrl.envs import inspect_env
from splitrl.launch import free_port
from splitrl.runs import load_checkpoint
from splitrl.settings import EnvSettings, PPOSettings, RunOptions, ScheduleSettings, TrainSettings
from splitrl.stages import Learner
from splitrl.transport import Message, PeerAbort, PeerGone

from .test_fleet import LINK, _first_row, _rows
from .test_schedules import TWO_ENVS


def test_a_resumed_fleet_starts_from_the_newest_iteration_stage1_and_every_edge_hold():
    """An edge interrupted while it wrote its checkpoint lacks the newest one stage1 has: all go back one; an
    edge that does not resume is dropped (here: the run cannot go on without it)."""
    from splitrl.schedule.roster import Roster
    from splitrl.transport.local import LocalTransport

    pairs = [LocalTransport.pair("stage1", "stage0", timeout=5) for _ in range(2)]
    roster = Roster([a for a, _ in pairs], {})
    roster.alive = [True, True]
    roster.hellos = {0: {"checkpoints": [4, 5]}, 1: {"checkpoints": [3, 4]}}
    assert roster.resume([4, 5]) == 4
    for _, edge in pairs:
        msg = edge.recv(timeout=1)
        assert (msg.kind, msg.header) == ("resume", {"iteration": 4})
    roster.hellos[1] = {}
    with pytest.raises(Exception, match="does not resume"):
        roster.resume([4, 5])


def test_a_resumed_fleets_places_number_on_from_stage1s_checkpoint():
    """Stage1's checkpoint keeps each place's link position: the place numbers on from it and the edge is told
    its side of it; a place the checkpoint does not know (no edge there then) starts from 1."""
    from splitrl.schedule.roster import Roster
    from splitrl.transport.local import LocalTransport

    pairs = [LocalTransport.pair("stage1", "stage0", timeout=5) for _ in range(2)]
    roster = Roster([a for a, _ in pairs], {})
    roster.alive = [True, True]
    roster.hellos = {0: {"checkpoints": [4]}, 1: {"checkpoints": [4]}}
    asked = []
    state = {"links": {"0": {"sent": 300, "received": 200}}}
    assert roster.resume([4], lambda point: asked.append(point) or state) == 4 and asked == [4]
    told = [edge.recv(timeout=1).header for _, edge in pairs]
    assert told == [{"iteration": 4, "link": {"sent": 200, "received": 300}}, {"iteration": 4}]
    assert pairs[0][0].sequence() == {"sent": 300, "received": 200}
    assert pairs[1][0].sequence()["sent"] < 10
    # A place lost as it is told starts its next session from 0, not from the checkpoint's position
    pairs = [LocalTransport.pair("stage1", "stage0", timeout=5) for _ in range(2)]
    roster = Roster([a for a, _ in pairs], {}, min_edges=1)
    roster.alive = [True, True]
    roster.hellos = {0: {"checkpoints": [4]}, 1: {"checkpoints": [4]}}
    pairs[0][0].send = lambda *args, **kwargs: (_ for _ in ()).throw(PeerGone("edge 0 vanished"))
    roster.resume([4], lambda point: state)
    assert roster.alive == [False, True] and pairs[0][0].sequence() == {"sent": 0, "received": 0}


def test_a_stale_edge_does_not_send_a_resumed_fleet_back_to_the_start():
    """An edge dropped earlier in the run kept only old checkpoints: the fleet goes on from the newest point
    --min-edges of them hold, without it; no such point is an error, not a silent start from scratch."""
    from splitrl.schedule.roster import Roster
    from splitrl.transport.local import LocalTransport

    pairs = [LocalTransport.pair("stage1", "stage0", timeout=5) for _ in range(3)]
    roster = Roster([a for a, _ in pairs], {}, min_edges=2)
    roster.alive = [True, True, True]
    roster.hellos = {0: {"checkpoints": [99, 100]}, 1: {"checkpoints": [99, 100]}, 2: {"checkpoints": [4, 5]}}
    assert roster.resume([99, 100]) == 100
    assert roster.alive == [True, True, False]
    assert [pairs[g][1].recv(timeout=1).header for g in (0, 1)] == [{"iteration": 100}] * 2
    with pytest.raises(PeerAbort, match="edge 2 has no checkpoint of iteration 100"):
        pairs[2][1].recv(timeout=1)
    roster = Roster([a for a, _ in pairs[:2]], {})
    roster.alive = [True, True]
    roster.hellos = {0: {"checkpoints": [4, 5]}, 1: {"checkpoints": []}}
    with pytest.raises(Exception, match="no iteration that stage1"):
        roster.resume([99, 100])


class _FakeLink:
    """An edge's link that answers from a list, or fails with ``error`` (a dead or hostile edge)."""

    def __init__(self, msgs=(), error=None):
        self.msgs, self.error, self.sent, self.aborted, self.sessions = list(msgs), error, [], None, 0
        self.peer = "fake edge"

    def recv(self, timeout=None):
        if self.error is not None:
            raise self.error
        return self.msgs.pop(0)

    def send(self, kind, tensors=None, header=None, timeout=None):
        if self.error is not None:
            raise self.error
        self.sent.append(kind)

    def abort(self, reason, timeout=1.0):
        self.aborted = reason

    def new_session(self):
        self.sessions += 1


def test_acting_as_edges_come_drops_an_edge_that_is_gone_or_silent_past_its_timeout():
    """`Roster.check`, what the as-they-come rollout asks of edges whose step has not come."""
    from splitrl.schedule.roster import Roster
    from splitrl.transport import PeerGone

    class Silent(_FakeLink):
        timeout = 1.0

        def check_alive(self):
            if self.error is not None:
                raise self.error

    links = [Silent(), Silent(error=PeerGone("edge 1 is gone")), Silent()]
    roster = _started(Roster(links, {}, min_edges=1))
    roster.check(0, silent=0.5)
    roster.check(1, silent=0.0)
    assert roster.live() == [0, 2]
    roster.check(2, silent=1.5)
    assert roster.live() == [0] and roster.dropped == 2 and "no message from fake edge within 1 s" in links[2].aborted


def _started(roster):
    roster.alive = [True] * len(roster.links)
    return roster


def test_a_roster_drops_an_edge_that_fails_and_ends_the_run_below_min_edges():
    from splitrl.schedule.roster import Roster
    from splitrl.transport import PeerGone, ProtocolError

    links = [_FakeLink([Message("iter_end", {"iteration": 1}, {})]), _FakeLink(error=PeerGone("edge 1 is gone")),
             _FakeLink([Message("step", {"iteration": 1}, {})])]  # edge 2 answers with the wrong kind
    roster = _started(Roster(links, {}, min_edges=1))
    assert [g for g, _ in roster.gather("iter_end", iteration=1)] == [0]
    assert roster.live() == [0] and roster.dropped == 2
    assert links[1].aborted is None and "ProtocolError" in links[2].aborted  # a gone edge's successor is not told
    assert links[1].sessions == links[2].sessions == 1  # whoever comes to their places next is a new edge
    idx = torch.tensor([10, 11, 12, 13])
    assert roster.members(idx, torch.tensor([0, 1, 2, 0])).tolist() == [10, 13]  # edges 1 and 2's samples out
    roster.send(1, "action")  # a dropped edge is sent nothing more
    roster.link(1).send("iter_stats")
    roster.link(0).send("iter_stats")
    assert links[0].sent == ["iter_stats"] and roster.dropped == 2

    everyone = _started(Roster([_FakeLink(error=PeerGone("edge 0 is gone")), _FakeLink()], {}))  # all of them
    assert everyone.members(idx, torch.tensor([0, 1, 1, 0])) is idx  # nobody dropped: the minibatch as it is
    with pytest.raises(PeerGone, match="^edge 0 is gone$"):
        everyone.expect(0, "step")
    assert everyone.alive == [True, True]
    three = _started(Roster([_FakeLink(error=PeerGone("edge 0 is gone")), _FakeLink(),
                             _FakeLink(error=ProtocolError("bad"))], {}, min_edges=2))
    assert three.expect(0, "step") is None
    with pytest.raises(ProtocolError, match=r"^bad \(edge 2; 1 of 3 edges left, fewer than --min-edges 2\)$"):
        three.expect(2, "step")


SMALL_FLEET = TrainSettings(total_steps=2 * 64, env=EnvSettings(env_id="CartPole-v1", num_envs=1, max_episode_steps=20),
                            model="mlp", hidden=16, ppo=PPOSettings(num_steps=32, epochs=2, minibatches=2),
                            schedule=ScheduleSettings(edges=2)).for_observation("vector")
"""Two edges of one CartPole each, two iterations: a fleet that costs little to run."""


def _feature_width(settings):
    return Learner(settings.fleet_view(), inspect_env(settings.env)).feature_dim


def test_the_door_drops_an_edge_whose_message_does_not_fit_naming_the_edge_and_the_tensor():
    """`Roster.expect` holds every message against the fleet's door (`splitrl.stages.door`): a misfit is that
    edge's `ProtocolError`, the edge named, and drops it as a failing link does; a ``train_fwd`` is held against
    the edge's share of the minibatch."""
    from splitrl.schedule.roster import Roster
    from splitrl.stages.door import Door
    from splitrl.transport import ProtocolError

    settings = TrainSettings(env=EnvSettings(env_id="CartPole-v1"), model="mlp", hidden=16,
                             schedule=ScheduleSettings(edges=3))
    door = Door(Learner(settings.fleet_view(), inspect_env(settings.env)), 1)
    width = door.learner.feature_dim
    good, bad = (Message("step", {"t": 0}, {"features": torch.zeros(1, w)}) for w in (width, width - 1))
    why = f"edge 1: step: tensor 'features': expected float32 [1, {width}], got float32 [1, {width - 1}]"
    links = [_FakeLink([good]), _FakeLink([bad]), _FakeLink([good])]
    roster = _started(Roster(links, {}, min_edges=1))
    roster.door = door
    assert [g for g, _ in roster.gather("step", t=0)] == [0, 2]
    assert roster.live() == [0, 2] and roster.dropped == 1 and f"ProtocolError: {why}" in links[1].aborted
    fwd = Message("train_fwd", {"epoch": 0, "mb": 0}, {"features": torch.zeros(2, width)})
    links[2].msgs.append(fwd)
    assert roster.expect(2, "train_fwd", rows=3, epoch=0, mb=0) is None  # its share was 3 samples, not 2
    assert "edge 2: train_fwd: tensor 'features': expected float32 [3, " in links[2].aborted
    links[0].msgs.append(fwd)
    assert roster.expect(0, "train_fwd", rows=2, epoch=0, mb=0) is fwd
    everyone = _started(Roster([_FakeLink([good]), _FakeLink([bad])], {}))
    everyone.door = door
    with pytest.raises(ProtocolError, match=f"^{re.escape(why)}$"):
        everyone.gather("step", t=0)


@pytest.mark.parametrize("min_edges", [1, 0])
def test_an_edge_whose_features_do_not_fit_is_dropped_at_the_door_and_the_fleet_trains_on(tmp_path, spawn, min_edges):
    """Edge 1 is a hostile peer written from docs/PROTOCOL.md (tests/hostile/peer.py): it says hello at edge 1's
    place and sends a first step whose features are 3 wide. With --min-edges 1 stage1 tells it why, drops it
    (logged, counted in fleet/dropped) and trains on with edge 0 to the end, both exiting 0; without, the run
    ends with the error, which names the edge and the tensor."""
    from ..hostile.peer import RawPeer, settings_hash

    port = free_port(count=4)
    args = [*SMALL_FLEET.to_argv(), "--threads", "1", "--checkpoint-every", "1", *LINK]
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "fleet"),
               "--min-edges", str(min_edges), *args)
    edge0 = spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "edge0"),
                  "--edge-id", "0", *args)
    s1.wait_for("edge 0 of 2 connected", timeout=60)
    peer = RawPeer(f"tcp://127.0.0.1:{port + 2}", bind=False, timeout=60)  # edge 1's port pair
    try:
        shared = SMALL_FLEET.shared()
        peer.send("hello", {"proto": 1, "role": "stage0", "settings_hash": settings_hash(shared), "settings": shared,
                            "edge": 1})
        assert peer.recv()[0] == "hello"
        peer.send("step", {"t": 0}, [("features", np.zeros((1, 3), dtype=np.float32))])
        kind, header, _ = peer.recv()
        while kind != "abort":  # (had it come late: a joiner's encoder first)
            kind, header, _ = peer.recv()
    finally:
        peer.close()
    why = f"edge 1: step: tensor 'features': expected float32 [1, {_feature_width(SMALL_FLEET)}], got float32 [1, 3]"
    assert why in header["reason"], header
    code0, out0 = edge0.finish(timeout=120)
    code1, out1 = s1.finish(timeout=60)
    if min_edges == 0:
        assert code1 == 1 and why in out1, out1
        assert code0 == 1 and why in out0, out0  # stage1's abort tells the honest edge why
        return
    assert code0 == 0 and code1 == 0, out0 + out1
    assert f"edge 1 dropped (ProtocolError: {why}); training goes on with 1 of 2 edges" in out1, out1
    rows = _rows(tmp_path / "edge0" / "metrics.jsonl")
    assert [row["iteration"] for row in rows] == [1, 2]
    assert rows[-1]["fleet/dropped"] == 1 and rows[-1]["fleet/edges"] == 1 and rows[-1]["fleet/act_batch_mean"] == 1


def test_min_edges_is_checked():
    settings = TrainSettings(total_steps=2 * 8192, schedule=ScheduleSettings(edges=2))
    with pytest.raises(ValueError, match="--min-edges 3: the fleet has --edges 2"):
        settings.validate(RunOptions(min_edges=3))
    assert "--min-edges must be >= 0, got -1" in RunOptions(min_edges=-1).errors()


@pytest.mark.parametrize("min_edges, act_wait", [(1, "all"), (0, "all"), (1, "2")])
def test_an_edge_that_dies_is_dropped_and_the_fleet_trains_on_above_min_edges(tmp_path, spawn, min_edges, act_wait):
    """Edge 1 is killed after its first iteration. With --min-edges 1 stage1 drops it (logged, counted in
    metrics) and trains on with edge 0 to the end, in lock step or acting as the edges come; with the
    default (every edge) the loss ends the run."""
    import signal

    port = free_port(count=4)
    iterations = 4  # the drop comes in iteration 2: two more train with one edge
    args = ["--num-envs", "1", "--total-steps", str(32 * 2 * iterations), *TWO_ENVS[4:], *LINK,
            "--min-edges", str(min_edges)]
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "fleet"), "--edges", "2",
               "--act-wait", act_wait, *args)
    edges = [spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / f"edge{k}"),
                   "--edges", "2", "--edge-id", str(k), *args) for k in range(2)]
    _first_row(edges[1], tmp_path / "edge1" / "metrics.jsonl", 120)
    edges[1].popen.send_signal(signal.SIGKILL)
    code0, out0 = edges[0].finish(timeout=120)
    code1, out1 = s1.finish(timeout=60)
    if min_edges == 0:
        assert code1 != 0 and "edge 1" in out1 and "gone" in out1, out1
        assert code0 != 0, out0
        return
    assert code0 == 0 and code1 == 0, out0 + out1
    assert "edge 1 dropped (PeerGone" in out1 and "training goes on with 1 of 2 edges" in out1, out1
    rows = _rows(tmp_path / "edge0" / "metrics.jsonl")
    assert [row["iteration"] for row in rows] == list(range(1, iterations + 1))
    assert rows[0]["fleet/edges"] == 2 and rows[0]["fleet/dropped"] == 0
    assert rows[-1]["fleet/edges"] == 1 and rows[-1]["fleet/dropped"] == 1 and rows[-1]["fleet/act_batch_mean"] == 1
    first, last = (load_checkpoint(tmp_path / "fleet", "stage1", i)["heads"] for i in (iterations - 1, iterations))
    assert not torch.equal(first["critic.0.weight"], last["critic.0.weight"])  # it learned after the loss


def test_an_edge_that_dies_and_comes_back_rejoins_with_the_fleets_encoder(tmp_path, spawn):
    """--min-edges 2 --rejoin: edge 1 is killed after its first iteration; edge 0 trains on alone to that
    iteration's end, where stage1 waits; a new stage0 takes edge 1's place, joins with edge 0's encoder and
    optimizer, and the two end the run with one encoder."""
    import signal

    port = free_port(count=4)
    iterations = 5
    args = ["--num-envs", "1", "--total-steps", str(32 * 2 * iterations), *TWO_ENVS[4:], *LINK, "--edges", "2"]
    s1 = spawn("stage1", "--bind", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "fleet"), *args,
               "--min-edges", "2", "--rejoin", "60")
    edge0, edge1 = (spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / f"edge{k}"),
                          *args, "--edge-id", str(k)) for k in range(2))
    _first_row(edge1, tmp_path / "edge1" / "metrics.jsonl", 120)
    edge1.popen.send_signal(signal.SIGKILL)
    s1.wait_for("edge 1 dropped", timeout=60)
    again = spawn("stage0", "--connect", f"tcp://127.0.0.1:{port}", "--run-dir", str(tmp_path / "again"), *args)
    outs = [edge0.finish(timeout=120), again.finish(timeout=120), s1.finish(timeout=60)]
    assert all(code == 0 for code, _ in outs), "\n".join(out for _, out in outs)
    assert "joined the fleet after its iteration" in outs[1][1]
    rows, rejoined = _rows(tmp_path / "edge0" / "metrics.jsonl"), _rows(tmp_path / "again" / "metrics.jsonl")
    assert [row["iteration"] for row in rows] == list(range(1, iterations + 1))
    assert rows[-1]["fleet/dropped"] == 1 and rows[-1]["fleet/joined"] == 1 and rows[-1]["fleet/edges"] == 2
    assert 2 < rejoined[0]["iteration"] <= iterations and rejoined[-1]["iteration"] == iterations
    assert rejoined[0]["fleet/edge"] == 1 and rejoined[0]["global_step"] == rows[rejoined[0]["iteration"] - 1]["global_step"]
    nets = [load_checkpoint(tmp_path / name, "stage0", iterations)["net"] for name in ("edge0", "again")]
    assert all(torch.equal(nets[0][name], nets[1][name]) for name in nets[0])  # one encoder again



def test_a_hello_is_answered_when_the_edges_receiving_connection_comes_up_after_it():
    """stage0's hello arrives before its receiving socket is connected: the answer waits for it (the link's
    --timeout), instead of failing after the short listen and leaving the hello consumed and unanswered."""
    import threading

    import zmq

    from splitrl.schedule.roster import Roster
    from splitrl.stages.protocol import LIMITS
    from splitrl.transport.handshake import PROTOCOL_VERSION, settings_hash
    from splitrl.transport.wire import decode, encode
    from splitrl.transport.zmq_transport import ZmqTransport, paired_endpoint

    shared = TrainSettings(schedule=ScheduleSettings(edges=2)).shared()
    link = ZmqTransport("tcp://127.0.0.1:0", bind=True, timeout=10, limits=LIMITS, heartbeat=2, name="edge 0")
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        push.connect(link.endpoint)
        header = {"proto": PROTOCOL_VERSION, "role": "stage0", "settings_hash": settings_hash(shared), "edge": 0}
        push.send_multipart(encode("hello", 0, header, None))
        late = threading.Timer(0.5, pull.connect, args=(paired_endpoint(link.endpoint),))
        late.start()
        time.sleep(0.2)
        roster = Roster([link], shared, min_edges=1)
        assert roster._answer(0, 0) is True
        late.join()
        assert pull.poll(5000) != 0
        reply = decode(pull.recv_multipart(), LIMITS)
        assert reply.kind == "hello" and reply.header["join_after"] == 0
    finally:
        link.close()
        push.close(0)
        pull.close(0)
        ctx.term()
