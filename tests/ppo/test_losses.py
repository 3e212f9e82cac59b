import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from splitrl.ppo.losses import explained_variance, ppo_loss

KEYS = {
    "losses/policy_loss", "losses/value_loss", "losses/entropy",
    "losses/approx_kl", "losses/old_approx_kl", "losses/clipfrac",
}


def test_hand_computed_example():
    new_lp = torch.tensor([0.0, math.log(1.5), math.log(0.5)])
    old_lp = torch.zeros(3)
    adv = torch.tensor([1.0, 1.0, -1.0])
    new_v = torch.tensor([1.0, 2.0, 3.0])
    old_v = torch.tensor([1.0, 1.0, 1.0])
    ret = torch.tensor([0.0, 2.0, 5.0])
    ent = torch.tensor([0.1, 0.2, 0.3])
    loss, stats = ppo_loss(new_lp, old_lp, adv, new_v, old_v, ret, ent, ent_coef=0.01, norm_adv=False)

    # ratio [1, 1.5, 0.5] -> clipped [1, 1.2, 0.8]; pessimistic max per sample: [-1, -1.2, 0.8]
    pg = (-1 - 1.2 + 0.8) / 3
    # unclipped sq err [1, 0, 4]; clipped values [1, 1.2, 1.2] -> [1, 0.64, 14.44]
    vl = 0.5 * (1 + 0.64 + 14.44) / 3
    assert set(stats) == KEYS and all(isinstance(x, float) for x in stats.values())
    assert stats["losses/policy_loss"] == pytest.approx(pg, abs=1e-6)
    assert stats["losses/value_loss"] == pytest.approx(vl, abs=1e-5)
    assert stats["losses/entropy"] == pytest.approx(0.2, abs=1e-6)
    assert stats["losses/clipfrac"] == pytest.approx(2 / 3)
    assert stats["losses/old_approx_kl"] == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3, abs=1e-6)
    kl = (0.5 - math.log(1.5) - 0.5 - math.log(0.5)) / 3
    assert stats["losses/approx_kl"] == pytest.approx(kl, abs=1e-6)
    assert loss.item() == pytest.approx(pg + 0.5 * vl - 0.01 * 0.2, abs=1e-5)


@pytest.mark.parametrize(
    "ratio,adv,grad_zero",
    [
        (1.5, 1.0, True),    # already improved beyond 1+eps: no further push
        (0.5, -1.0, True),   # already reduced beyond 1-eps
        (1.5, -1.0, False),  # moved the wrong way: still corrected
        (0.5, 1.0, False),
        (1.1, 1.0, False),   # inside the trust region
    ],
)
def test_policy_clipping_gradient(ratio, adv, grad_zero):
    new_lp = torch.tensor([math.log(ratio)], requires_grad=True)
    loss, _ = ppo_loss(
        new_lp, torch.zeros(1), torch.tensor([adv]), torch.zeros(1), torch.zeros(1),
        torch.zeros(1), torch.zeros(1), norm_adv=False,
    )
    loss.backward()
    if grad_zero:
        assert new_lp.grad.item() == 0.0
    else:
        assert new_lp.grad.item() != 0.0


def test_value_clipping():
    old_v, ret = torch.tensor([1.0]), torch.tensor([5.0])
    args = (torch.zeros(1), torch.zeros(1), torch.zeros(1))

    def vloss(new, clip):
        new_v = torch.tensor([new], requires_grad=True)
        loss, stats = ppo_loss(*args, new_v, old_v, ret, torch.zeros(1), clip_vloss=clip, norm_adv=False)
        loss.backward()
        return stats["losses/value_loss"], new_v.grad.item()

    # moved too far toward the target: clipped error (1.2 vs 5) dominates, no gradient
    v, g = vloss(3.0, True)
    assert v == pytest.approx(0.5 * 3.8**2, abs=1e-5) and g == 0.0
    v, g = vloss(3.0, False)
    assert v == pytest.approx(0.5 * 2.0**2) and g != 0.0
    # moved away from target: unclipped error dominates, gradient flows
    v, g = vloss(0.0, True)
    assert v == pytest.approx(0.5 * 25.0) and g < 0
    # new_values shaped (M, 1) as a critic emits is accepted
    loss, _ = ppo_loss(*args, torch.tensor([[3.0]]), old_v, ret, torch.zeros(1), norm_adv=False)
    assert loss.shape == ()


def test_advantage_normalisation_is_affine_invariant():
    g = torch.Generator().manual_seed(0)
    new_lp, old_lp = 0.1 * torch.randn(32, generator=g), 0.1 * torch.randn(32, generator=g)
    adv = torch.randn(32, generator=g)
    rest = (torch.zeros(32), torch.zeros(32), torch.zeros(32), torch.zeros(32))
    l1, _ = ppo_loss(new_lp, old_lp, adv, *rest)
    l2, _ = ppo_loss(new_lp, old_lp, 7.0 * adv + 3.0, *rest)
    assert_close(l1, l2)
    l3, _ = ppo_loss(new_lp, old_lp, 7.0 * adv + 3.0, *rest, norm_adv=False)
    assert not torch.allclose(l1, l3)


def test_approx_kl_zero_when_unchanged():
    lp = torch.randn(10)
    _, stats = ppo_loss(lp, lp.clone(), torch.randn(10), *(torch.zeros(10),) * 4)
    assert stats["losses/approx_kl"] == 0.0 and stats["losses/clipfrac"] == 0.0


def test_explained_variance():
    ret = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert explained_variance(ret, ret) == pytest.approx(1.0)
    assert explained_variance(torch.full((4,), ret.mean().item()), ret) == pytest.approx(0.0)
    assert math.isnan(explained_variance(ret, torch.full((4,), 3.0)))
    v = torch.tensor([0.5, 2.5, 2.0, 5.0])
    y, p = ret.numpy(), v.numpy()
    assert explained_variance(v, ret) == pytest.approx(1 - np.var(y - p) / np.var(y), abs=1e-6)
    assert isinstance(explained_variance(v, ret), float)
