import math

import pytest
import torch
from torch.distributions import Normal, TanhTransform, TransformedDistribution
from torch.testing import assert_close

from splitrl.ppo.distributions import LOG_STD_MAX, LOG_STD_MIN, TanhGaussian, clamp_log_std


def make(B=6, A=3, seed=0, per_sample_std=False):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(B, A, generator=g)
    shape = (B, A) if per_sample_std else (A,)
    log_std = clamp_log_std(0.5 * torch.randn(*shape, generator=g))
    return mean, log_std


def test_clamp_log_std():
    x = torch.tensor([-100.0, -5.0, 0.3, 2.0, 100.0])
    assert_close(clamp_log_std(x), torch.tensor([LOG_STD_MIN, -5.0, 0.3, LOG_STD_MAX, LOG_STD_MAX]))


@pytest.mark.parametrize("per_sample_std", [False, True])
def test_log_prob_matches_torch_transformed_distribution(per_sample_std):
    mean, log_std = make(per_sample_std=per_sample_std)
    dist = TanhGaussian(mean, log_std)
    u = (mean + torch.randn(mean.shape, generator=torch.Generator().manual_seed(1))).clamp(-3, 3)
    ref_dist = TransformedDistribution(
        Normal(mean.double(), log_std.exp().double().expand_as(mean)), [TanhTransform()]
    )
    ref = ref_dist.log_prob(torch.tanh(u.double())).sum(-1)
    lp = dist.log_prob(u)
    assert lp.shape == (mean.shape[0],) and lp.dtype == torch.float32
    assert_close(lp.double(), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("value", [10.0, 50.0, 100.0])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_log_prob_finite_where_tanh_saturates(value, sign):
    mean, log_std = make(B=4, A=2)
    mean.requires_grad_(True)
    log_std.requires_grad_(True)
    u = torch.full((4, 2), sign * value)
    # the regime that broke the baseline: the squashed action is exactly on the bound
    assert (torch.tanh(u) == sign * 1.0).all()
    assert torch.isinf(torch.atanh(torch.tanh(u))).all()

    lp = TanhGaussian(mean, log_std).log_prob(u)
    assert torch.isfinite(lp).all()
    lp.sum().backward()
    assert torch.isfinite(mean.grad).all() and torch.isfinite(log_std.grad).all()


def test_stable_jacobian_identity_in_float64():
    u = torch.linspace(-8, 8, 101, dtype=torch.float64)
    dist = TanhGaussian(torch.zeros(101, 1, dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    base = Normal(0.0, 1.0).log_prob(u)
    naive = base - torch.log1p(-torch.tanh(u) ** 2)
    assert_close(dist.log_prob(u[:, None]), naive)


def test_sampling_reproducible_with_seeded_generator():
    mean, log_std = make()
    dist = TanhGaussian(mean, log_std)
    a = dist.sample(torch.Generator().manual_seed(42))
    b = dist.sample(torch.Generator().manual_seed(42))
    c = dist.sample(torch.Generator().manual_seed(43))
    assert a.shape == mean.shape and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not a.requires_grad


def test_sample_statistics():
    mean = torch.tensor([[0.5, -1.0]]).expand(20000, 2)
    log_std = torch.tensor([math.log(0.3), math.log(2.0)])
    u = TanhGaussian(mean, log_std).sample(torch.Generator().manual_seed(0))
    assert_close(u.mean(0), torch.tensor([0.5, -1.0]), atol=0.05, rtol=0)
    assert_close(u.std(0), torch.tensor([0.3, 2.0]), atol=0.05, rtol=0)


def test_entropy_is_base_gaussian_entropy():
    mean, log_std = make(per_sample_std=True)
    ent = TanhGaussian(mean, log_std).entropy()
    assert ent.shape == (mean.shape[0],)
    assert_close(ent, Normal(mean, log_std.exp()).entropy().sum(-1))
