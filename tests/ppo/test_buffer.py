import numpy as np
import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from splitrl.ppo.buffer import RolloutBuffer, shuffled_minibatches
from splitrl.ppo.gae import compute_gae

T, N, A = 5, 3, 2


class Calls(TorchDispatchMode):
    """The names of the torch operators dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def filled_buffer(seed=0):
    g = torch.Generator().manual_seed(seed)
    buf = RolloutBuffer(T, N, A)
    for t in range(T):
        buf.add(t, actions=torch.randn(N, A, generator=g), logprobs=torch.randn(N, generator=g),
                values=torch.randn(N, 1, generator=g))  # (N, 1) as a critic emits
        term = torch.rand(N, generator=g) < 0.2
        trunc = torch.rand(N, generator=g) < 0.2
        buf.add_outcome(t, rewards=torch.randn(N, generator=g), terminated=term, truncated=trunc,
                        final_values=torch.randn(N, generator=g))
    return buf


def test_shapes_and_dtypes():
    buf = RolloutBuffer(T, N, A)
    assert buf.actions.shape == (T, N, A)
    for name in ["logprobs", "values", "rewards", "terminated", "truncated", "final_values"]:
        x = getattr(buf, name)
        assert x.shape == (T, N) and x.dtype == torch.float32


def test_add_and_add_outcome_store_values():
    buf = RolloutBuffer(T, N, A)
    acts = torch.tensor([[100.0, -100.0], [0.1, 0.2], [3.0, 4.0]])
    buf.add(2, actions=acts, logprobs=torch.tensor([1.0, 2.0, 3.0]), values=torch.tensor([[4.0], [5.0], [6.0]]))
    buf.add_outcome(
        2, rewards=np.array([1.0, 0.0, -1.0]), terminated=np.array([False, True, True]),
        truncated=np.array([True, False, True]), final_values=torch.tensor([7.0, 8.0, 9.0]),
    )
    assert torch.equal(buf.actions[2], acts)  # pre-tanh u stored verbatim
    assert_close(buf.logprobs[2], torch.tensor([1.0, 2.0, 3.0]))
    assert_close(buf.values[2], torch.tensor([4.0, 5.0, 6.0]))
    assert_close(buf.rewards[2], torch.tensor([1.0, 0.0, -1.0]))
    assert_close(buf.terminated[2], torch.tensor([0.0, 1.0, 1.0]))
    assert_close(buf.truncated[2], torch.tensor([1.0, 0.0, 1.0]))
    # only the truncated-and-not-terminated env keeps its final value
    assert_close(buf.final_values[2], torch.tensor([7.0, 0.0, 0.0]))
    assert (buf.rewards[[0, 1, 3, 4]] == 0).all()


def test_a_step_already_in_shape_is_stored_without_conversions_and_by_rows_the_same():
    buf, rows = RolloutBuffer(T, N, A), RolloutBuffer(T, N, A)
    step = dict(actions=torch.randn(N, A), logprobs=torch.randn(N), values=torch.randn(N))
    outcome = dict(rewards=torch.randn(N), terminated=torch.tensor([False, True, True]),
                   truncated=torch.tensor([True, False, True]), final_values=torch.randn(N))
    with Calls() as calls:
        buf.add(1, **step)
        buf.add_outcome(1, **outcome)
    # each tensor copied into its slot, the flags converted by that copy: no detach, reshape or dtype copy first
    assert not {"detach", "view", "_to_copy", "reshape"} & set(calls.names), calls.names
    rows.add_rows(torch.tensor([1, 1, 1]), torch.arange(N), **step)
    rows.add_outcome_rows(torch.tensor([1, 1, 1]), torch.arange(N), **outcome)
    for name in ("actions", "logprobs", "values", "rewards", "terminated", "truncated", "final_values"):
        assert torch.equal(getattr(buf, name), getattr(rows, name)), name
    assert buf.terminated[1].tolist() == [0.0, 1.0, 1.0] and buf.final_values[1, 1:].tolist() == [0.0, 0.0]


def test_final_values_optional_unless_needed():
    buf = RolloutBuffer(T, N, A)
    buf.add_outcome(0, rewards=torch.zeros(N), terminated=torch.zeros(N), truncated=torch.zeros(N))
    buf.add_outcome(1, rewards=torch.zeros(N), terminated=torch.tensor([1.0, 0, 0]),
                    truncated=torch.tensor([1.0, 0, 0]))
    assert (buf.final_values == 0).all()
    with pytest.raises(ValueError):
        buf.add_outcome(2, rewards=torch.zeros(N), terminated=torch.zeros(N),
                        truncated=torch.tensor([0.0, 1.0, 0.0]))


def test_finish_matches_compute_gae_and_flattens_step_major():
    buf = filled_buffer()
    last = torch.randn(N)
    buf.finish(last, gamma=0.9, gae_lambda=0.8)
    adv, ret = compute_gae(buf.rewards, buf.values, buf.terminated, buf.truncated,
                           buf.final_values, last, 0.9, 0.8)
    assert_close(buf.advantages, adv)
    assert_close(buf.returns, ret)
    assert buf.b_actions.shape == (T * N, A)
    for name in ["b_logprobs", "b_values", "b_advantages", "b_returns"]:
        assert getattr(buf, name).shape == (T * N,)
    for t in range(T):
        for n in range(N):
            i = t * N + n
            assert torch.equal(buf.b_actions[i], buf.actions[t, n])
            assert buf.b_logprobs[i] == buf.logprobs[t, n]
            assert buf.b_values[i] == buf.values[t, n]
            assert buf.b_advantages[i] == adv[t, n]
            assert buf.b_returns[i] == ret[t, n]
    # same ordering as a (T, N, ...) observation array reshaped
    obs = np.arange(T * N * 4).reshape(T, N, 4)
    b_obs = obs.reshape(-1, 4)
    assert (b_obs[2 * N + 1] == obs[2, 1]).all()


def test_shuffled_minibatches():
    batch_size = filled_buffer().batch_size
    mbs = shuffled_minibatches(batch_size, torch.Generator().manual_seed(0), 5)
    assert len(mbs) == 5 and all(mb.dtype == torch.long and mb.shape == (3,) for mb in mbs)
    assert sorted(torch.cat(mbs).tolist()) == list(range(T * N))
    again = shuffled_minibatches(batch_size, torch.Generator().manual_seed(0), 5)
    assert all(torch.equal(a, b) for a, b in zip(mbs, again))
    other = shuffled_minibatches(batch_size, torch.Generator().manual_seed(1), 5)
    assert not all(torch.equal(a, b) for a, b in zip(mbs, other))
    for bad in [4, 0]:
        with pytest.raises(ValueError):
            shuffled_minibatches(batch_size, None, bad)


def test_minibatch_schedule_is_a_pure_function_of_seed_and_iteration():
    from splitrl.ppo import minibatch_schedule

    a = minibatch_schedule(seed=3, iteration=7, epochs=2, batch_size=12, num_minibatches=3)
    b = minibatch_schedule(seed=3, iteration=7, epochs=2, batch_size=12, num_minibatches=3)
    c = minibatch_schedule(seed=3, iteration=8, epochs=2, batch_size=12, num_minibatches=3)
    assert len(a) == 2 and all(len(epoch) == 3 for epoch in a)
    for epoch_a, epoch_b in zip(a, b):
        for x, y in zip(epoch_a, epoch_b):
            assert torch.equal(x, y)
    for epoch in a:
        assert sorted(torch.cat(epoch).tolist()) == list(range(12))
    assert not all(torch.equal(x, y) for x, y in zip(a[0], c[0]))
    assert not all(torch.equal(x, y) for x, y in zip(a[0], a[1]))


def test_final_values_of_zero_store_what_zeros_do_with_no_mask_worked_out():
    outcome = dict(rewards=torch.randn(N), terminated=torch.tensor([False, True, True]),
                   truncated=torch.tensor([True, False, True]))
    scalar, tensor, rows = RolloutBuffer(T, N, A), RolloutBuffer(T, N, A), RolloutBuffer(T, N, A)
    for buf in (scalar, tensor, rows):
        buf.final_values.fill_(5.0)  # what an earlier rollout left: each step writes its own
    with Calls() as calls:
        scalar.add_outcome(1, **outcome, final_values=0.0)
    assert not {"where", "bitwise_and", "bitwise_not"} & set(calls.names), calls.names
    tensor.add_outcome(1, **outcome, final_values=torch.zeros(N))
    rows.add_outcome_rows(torch.tensor([1, 1, 1]), torch.arange(N), **outcome, final_values=0.0)
    for buf in (tensor, rows):
        for name in ("rewards", "terminated", "truncated", "final_values"):
            assert torch.equal(getattr(scalar, name), getattr(buf, name)), name
    assert scalar.final_values[1].tolist() == [0.0] * N and scalar.final_values[0].tolist() == [5.0] * N
