"""`splitrl.schedule.workers`: a minibatch's micro-batches on worker threads at once, with the numbers of one after
another."""

import copy

import pytest
import torch
from torch import nn

from splitrl.devices import place
from splitrl.envs import inspect_env
from splitrl.models import agent
from splitrl.schedule import workers
from splitrl.schedule.common import PhaseClock
from splitrl.schedule.workers import add_in_order, concurrent_safe, configure, part_workers
from splitrl.settings import TrainSettings

from .test_schedules import _assert_same_states, _metrics, _states, _twin, TWO_ENVS


@pytest.fixture(autouse=True)
def default_workers():
    yield
    configure(0)


@pytest.fixture(scope="module")
def nets():
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    return agent(settings.for_observation(spec.observation), spec), spec


def test_the_built_in_networks_may_take_their_parts_at_once_and_stateful_or_random_ones_may_not(nets):
    (encoder, heads), _ = nets
    assert concurrent_safe(encoder) and concurrent_safe(heads)
    # A BatchNorm's running statistics and a Dropout's draws would depend on which part ran first.
    assert not concurrent_safe(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)))
    assert not concurrent_safe(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)))

    class Mine(nn.Linear):  # a subclass may draw or keep state: not known to be safe
        pass

    assert not concurrent_safe(nn.Sequential(Mine(4, 4)))
    with_buffer = nn.Linear(4, 4)
    with_buffer.register_buffer("seen", torch.zeros(1))
    assert not concurrent_safe(with_buffer)
    hooked = nn.Linear(4, 4)
    hooked.register_forward_pre_hook(lambda module, args: None)  # a hook may rewrite the module it runs on
    assert not concurrent_safe(hooked)
    assert not concurrent_safe(nn.Embedding(4, 4, max_norm=1.0))  # renormalises its weight in its forward
    # --channels-last's hook only lays a convolution's input out: its micro-batches still go at once
    assert concurrent_safe(place(copy.deepcopy(encoder), torch.device("cpu"), channels_last=True))


def test_parts_on_workers_sum_to_the_gradients_of_the_parts_taken_in_turn_bit_for_bit(nets):
    """Four micro-batches' backwards on two workers, the last submitted first, give what autograd accumulates
    when they run one after another; summed in the reverse order, they do not (so the order is what is tested)."""
    (encoder, _), spec = nets
    params = list(encoder.parameters())
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 256, (128,) + tuple(spec.row_shape), dtype=torch.uint8, generator=g).chunk(4)
    upstream = [torch.randn(len(r), encoder(r[:1]).shape[1], generator=g) for r in rows]

    def summed(parts):
        for p in params:
            p.grad = None
        add_in_order(params, parts)
        out = [p.grad for p in params]
        for p in params:
            p.grad = None
        return out

    for r, u in zip(rows, upstream):
        torch.autograd.backward(encoder(r), u)
    in_turn = [p.grad.clone() for p in params]

    configure(2)
    pool = part_workers(encoder)
    assert pool is not None and pool.workers == 2
    clock = PhaseClock()

    def part(k):
        return list(torch.autograd.grad(encoder(rows[k]), params, upstream[k]))

    tasks = {k: pool.submit(clock, "encoder", part, k) for k in reversed(range(4))}
    grads = [tasks[k].result() for k in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(summed(grads), in_turn))
    assert clock.seconds["encoder"] > 0  # the workers' seconds count in the stage's clock
    assert not all(torch.equal(a, b) for a, b in zip(summed(grads[::-1]), in_turn))


def test_the_number_of_workers_is_the_options(nets):
    (encoder, _), _ = nets
    configure(1)
    assert part_workers(encoder) is None
    configure(3)
    assert part_workers(encoder).workers == 3
    configure(0)
    pool = part_workers(encoder)
    assert (pool.workers if pool else 1) == workers.worker_count(torch.get_num_threads())
    assert part_workers(nn.Sequential(nn.Dropout(0.5))) is None
    configure(0)
    assert workers.worker_count(1, cores=4) == 4 and workers.worker_count(0, cores=4) == 1  # torch's default: all
    with pytest.raises(ValueError, match=">= 0"):
        configure(-1)


def test_a_run_with_parts_on_workers_computes_what_it_computes_with_the_parts_in_turn(tmp_path, monkeypatch):
    """Four micro-batches a minibatch through both stages of the twin, on workers and in turn: the same weights
    and the same metrics, bit for bit."""
    args = TWO_ENVS + ["--microbatches", "4"]
    used = []
    submit = workers.PartWorkers.submit
    monkeypatch.setattr(workers.PartWorkers, "submit",
                        lambda self, clock, phase, fn, *a: used.append(phase) or submit(self, clock, phase, fn, *a))
    _twin(tmp_path / "in-turn", *args, "--part-workers", "1")
    assert not used
    _twin(tmp_path / "workers", *args, "--part-workers", "2")
    assert {"encoder", "heads"} <= set(used)  # both stages took their parts on workers
    _assert_same_states(_states(tmp_path / "in-turn"), _states(tmp_path / "workers"))
    assert _metrics(tmp_path / "in-turn") == _metrics(tmp_path / "workers")
