"""One encoder across a fleet, verified (`splitrl.schedule.agreement`): the encoder most edges report is the fleet's,
an edge that reports another is dropped and named, and a relayed ``encoder_state`` that is not the fleet's encoder
never reaches a joining edge."""

import pytest
import torch

from splitrl.envs import inspect_env
from splitrl.schedule.agreement import StateCheck, fleet_digests
from splitrl.schedule.roster import Roster
from splitrl.settings import EnvSettings, ScheduleSettings, TrainSettings
from splitrl.stages import Edge
from splitrl.stages.limits import EdgeLimits
from splitrl.transport import Message, ProtocolError


class _Link:
    """An edge's link that answers from a list and keeps what it was sent."""

    def __init__(self, msgs=()):
        self.msgs, self.sent, self.aborted, self.peer = list(msgs), [], None, "fake edge"

    def recv(self, timeout=None):
        return self.msgs.pop(0)

    def send(self, kind, tensors=None, header=None, timeout=None):
        self.sent.append((kind, tensors, header))

    def abort(self, reason, timeout=1.0):
        self.aborted = reason

    def new_session(self):
        pass


def _roster(links, min_edges=0):
    roster = Roster(links, {}, min_edges=min_edges)
    roster.alive = [True] * len(links)
    return roster


def _end(digests):
    return Message("iter_end", {"iteration": 4, "checkpoint": False, "eval": False, "encoder": digests}, {})


A = {"net.b": "1" * 32, "net.w": "a" * 32}
B = {"net.b": "1" * 32, "net.w": "b" * 32}


def test_the_encoder_most_edges_report_is_the_fleets_and_an_edge_that_reports_another_is_dropped():
    links = [_Link(), _Link(), _Link()]
    roster = _roster(links, min_edges=1)
    ends = [(0, _end(A)), (1, _end(B)), (2, _end(A))]
    assert fleet_digests(roster, ends, 4) == A
    assert roster.live() == [0, 2] and roster.dropped == 1
    assert links[1].aborted.endswith("edge 1: iter_end: header 'encoder': tensor 'net.w': its encoder is not the fleet's "
                                     "after iteration 4 (digest bbbbbbbbbbbb.., edges 0, 2: aaaaaaaaaaaa..)")
    alone = _roster([_Link(), _Link(), _Link()])  # without --min-edges the run ends, naming the edge and tensor
    with pytest.raises(ProtocolError, match=r"^edge 1: iter_end: header 'encoder': tensor 'net.w': its encoder"):
        fleet_digests(alone, ends, 4)


def test_two_edges_that_disagree_end_the_run_naming_both():
    roster = _roster([_Link(), _Link()], min_edges=1)
    with pytest.raises(ProtocolError, match=r"none of them on more edges than the others; tensor 'net.w': edge 0: "
                                            r"aaaaaaaaaaaa..; edge 1: bbbbbbbbbbbb.. \(with --encoder-sync grad honest "
                                            r"edges agree bit for bit only where they compute alike: .*\)$"):
        fleet_digests(roster, [(0, _end(A)), (1, _end(B))], 4)
    assert fleet_digests(_roster([_Link(), _Link()]), [(0, _end(A)), (1, _end(dict(A)))], 4) == A


def _stepped_edge(sync):
    settings = TrainSettings(env=EnvSettings(num_envs=1), schedule=ScheduleSettings(edges=2, encoder_sync=sync))
    edge = Edge(settings, inspect_env(settings.env))
    sum(p.square().sum() for p in edge.net.parameters()).backward()
    edge.optimizer_step()
    edge.train_iteration, edge.global_step = 3, 384
    return edge


@pytest.mark.parametrize("sync", ["grad", "avg"])
def test_a_relayed_encoder_state_is_the_fleets_encoder_tensor_by_tensor(sync):
    edge = _stepped_edge(sync)
    tensors, header = edge.encoder_state()
    check = StateCheck(edge.fleet.digests(moments=sync == "grad"), EdgeLimits(edge.settings.schedule), 3, 384)
    honest = Message("encoder_state", header, tensors)
    assert check(honest) is honest
    weight = next(name for name in tensors if name.startswith("net."))
    for crafted in (-tensors[weight], torch.full_like(tensors[weight], 1e30)):
        with pytest.raises(ProtocolError, match=rf"^encoder_state: tensor '{weight}': not the fleet's encoder after "
                                                r"iteration 3 \(digest \w{12}\.\., the edges reported \w{12}\.\.\)$"):
            check(Message("encoder_state", header, {**tensors, weight: crafted}))
    moment = next(name for name in tensors if name.startswith("exp_avg."))
    wrong = Message("encoder_state", header, {**tensors, moment: torch.full_like(tensors[moment], 1e30)})
    with pytest.raises(ProtocolError, match=f"tensor '{moment}': " + (
            "not the fleet's encoder" if sync == "grad" else r"a value of 1e\+30, beyond --edge-grad-limit")):
        check(wrong)  # grad: the moments are the fleet's too; avg: each edge's own, held against the limit
    with pytest.raises(ProtocolError, match="header 'global_step': expected the fleet's 384 env steps after "
                                            "iteration 3, got 385"):
        check(Message("encoder_state", {**header, "global_step": 385}, tensors))


def test_a_joiner_gets_the_second_sources_encoder_when_the_firsts_is_not_the_fleets():
    edge = _stepped_edge("grad")
    tensors, header = edge.encoder_state()
    check = StateCheck(edge.fleet.digests(moments=True), EdgeLimits(edge.settings.schedule), 3, 384)
    weight = next(iter(tensors))
    links = [_Link([Message("encoder_state", header, {**tensors, weight: -tensors[weight]})]),
             _Link([Message("encoder_state", header, tensors)]), _Link()]
    roster = _roster(links, min_edges=1)
    roster.alive[2] = False  # the place the joiner came to
    roster.welcome([2], [0, 1], 3, check)
    assert roster.live() == [1, 2] and roster.joined == 1 and roster.dropped == 1
    assert f"edge 0: encoder_state: tensor '{weight}': not the fleet's encoder" in links[0].aborted
    kind, sent, _ = links[2].sent[0]
    assert kind == "encoder_state" and all(torch.equal(sent[name], tensors[name]) for name in tensors)
    # The only source lies: the joiner is told to come again, and with no edge left the run ends naming it.
    links = [_Link([Message("encoder_state", header, {**tensors, weight: -tensors[weight]})]), _Link()]
    roster = _roster(links, min_edges=1)
    roster.alive[1] = False
    with pytest.raises(ProtocolError, match=rf"^edge 0: encoder_state: tensor '{weight}': not the fleet's encoder"):
        roster.welcome([1], [0], 3, check)


def test_an_edges_digests_cover_its_parameters_not_the_buffers_of_its_own_data():
    from torch import nn

    from splitrl.stages.fleet_encoder import EdgeEncoder

    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    digests = EdgeEncoder(net, None, lambda: net).digests(moments=True)
    assert sorted(digests) == ["net.0.bias", "net.0.weight", "net.1.bias", "net.1.weight"]
    assert all(len(d) == 32 and not d.strip("0123456789abcdef") for d in digests.values())
    net[0].weight.data[0, 0] += 1e-7  # one ulp or so: another digest
    assert EdgeEncoder(net, None, lambda: net).digests(moments=True)["net.0.weight"] != digests["net.0.weight"]
