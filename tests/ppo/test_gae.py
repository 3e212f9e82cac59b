import math

import pytest
import torch
from torch.testing import assert_close

from splitrl.ppo.gae import compute_gae


def lambda_return_reference(r, v, term, trunc, fv, last, gamma, lam):
    """Independent reference: lambda-return as a weighted average of n-step returns,
    computed episode by episode with plain python floats.

    Both flags set => terminated wins (no bootstrap)."""
    T, N = len(r), len(r[0])
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        start = 0
        while start < T:
            end = start
            while end < T - 1 and not (term[end][n] or trunc[end][n]):
                end += 1
            if term[end][n]:
                end_value = 0.0
            elif trunc[end][n]:
                end_value = fv[end][n]
            else:  # rollout cut mid-episode
                end_value = last[n]
            for t in range(start, end + 1):
                horizon = end - t + 1

                def n_step(k):
                    g = sum(gamma**i * r[t + i][n] for i in range(k))
                    boot = end_value if k == horizon else v[t + k][n]
                    return g + gamma**k * boot

                g_lam = (1 - lam) * sum(lam ** (k - 1) * n_step(k) for k in range(1, horizon))
                g_lam += lam ** (horizon - 1) * n_step(horizon)
                adv[t][n] = g_lam - v[t][n]
            start = end + 1
    return adv


def run_both(r, v, term, trunc, fv, last, gamma=0.99, lam=0.95):
    adv, ret = compute_gae(r, v, term, trunc, fv, last, gamma, lam)
    ref = lambda_return_reference(
        r.tolist(), v.tolist(), term.bool().tolist(), trunc.bool().tolist(),
        fv.tolist(), last.tolist(), gamma, lam,
    )
    ref = torch.tensor(ref, dtype=torch.float32)
    assert adv.dtype == torch.float32 and adv.shape == r.shape
    assert_close(adv, ref)
    assert_close(ret, ref + v)
    return adv


def random_case(seed, T, N, p_term=0.1, p_trunc=0.1):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(T, N, generator=g)
    v = torch.randn(T, N, generator=g)
    term = torch.rand(T, N, generator=g) < p_term
    trunc = torch.rand(T, N, generator=g) < p_trunc
    fv = torch.randn(T, N, generator=g)
    last = torch.randn(N, generator=g)
    return r, v, term, trunc, fv, last


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.9, 1.0), (0.95, 0.0), (1.0, 0.5)])
def test_matches_reference_random(seed, gamma, lam):
    r, v, term, trunc, fv, last = random_case(seed, T=17, N=4, p_term=0.15, p_trunc=0.15)
    run_both(r, v, term, trunc, fv, last, gamma, lam)


def test_random_case_contains_both_flags():
    # guard: the random cases above must actually exercise simultaneous flags
    cases = [random_case(s, T=17, N=4, p_term=0.15, p_trunc=0.15) for s in range(8)]
    assert any((term & trunc).any() for _, _, term, trunc, _, _ in cases)


def test_float_flags_accepted():
    r, v, term, trunc, fv, last = random_case(0, T=9, N=3, p_term=0.2, p_trunc=0.2)
    a_bool, _ = compute_gae(r, v, term, trunc, fv, last)
    a_float, _ = compute_gae(r, v, term.float(), trunc.float(), fv, last)
    assert_close(a_bool, a_float)


def test_T_equals_1():
    r = torch.tensor([[1.0, 2.0, 3.0]])
    v = torch.tensor([[0.5, 0.5, 0.5]])
    term = torch.tensor([[False, True, False]])
    trunc = torch.tensor([[False, False, True]])
    fv = torch.tensor([[9.0, 9.0, 4.0]])
    last = torch.tensor([2.0, 7.0, 7.0])
    adv = run_both(r, v, term, trunc, fv, last, gamma=0.9, lam=0.95)
    # not done -> last_value; terminated -> 0; truncated -> final_value
    assert_close(adv, torch.tensor([[1 + 0.9 * 2 - 0.5, 2 - 0.5, 3 + 0.9 * 4 - 0.5]]))


def test_truncation_at_last_step_uses_final_value_not_last_value():
    T, N = 5, 2
    r, v, _, _, fv, last = random_case(3, T, N)
    term = torch.zeros(T, N, dtype=torch.bool)
    trunc = torch.zeros(T, N, dtype=torch.bool)
    trunc[-1, 0] = True
    adv = run_both(r, v, term, trunc, fv, last)
    expected_last = r[-1, 0] + 0.99 * fv[-1, 0] - v[-1, 0]
    assert_close(adv[-1, 0], expected_last)


def test_terminated_wins_over_truncated_and_unused_final_values_ignored():
    T, N = 6, 3
    r, v, _, _, fv, last = random_case(5, T, N)
    term = torch.zeros(T, N, dtype=torch.bool)
    trunc = torch.zeros(T, N, dtype=torch.bool)
    term[2, 0] = trunc[2, 0] = True  # both at once: no bootstrap
    trunc[3, 1] = True
    fv = torch.where(trunc & ~term, fv, torch.full_like(fv, math.nan))
    adv = run_both(r, v, term, trunc, fv, last)
    assert torch.isfinite(adv).all()
    assert_close(adv[2, 0], r[2, 0] - v[2, 0])


def test_recursion_does_not_cross_boundary():
    # everything after the boundary is huge; the pre-boundary advantage must not see it
    T = 4
    r = torch.tensor([[1.0], [1.0], [1000.0], [1000.0]])
    v = torch.zeros(T, 1)
    term = torch.tensor([[False], [True], [False], [False]])
    trunc = torch.zeros(T, 1, dtype=torch.bool)
    adv, _ = compute_gae(r, v, term, trunc, torch.zeros(T, 1), torch.zeros(1), gamma=1.0, gae_lambda=1.0)
    assert_close(adv[:2, 0], torch.tensor([2.0, 1.0]))
    assert_close(adv[2:, 0], torch.tensor([2000.0, 1000.0]))


def test_no_dones_equals_plain_discounted_sum_when_lambda_one():
    T, N = 7, 2
    r, v, _, _, fv, last = random_case(11, T, N)
    z = torch.zeros(T, N, dtype=torch.bool)
    _, ret = compute_gae(r, v, z, z, fv, last, gamma=0.9, gae_lambda=1.0)
    expected = torch.stack([
        sum(0.9**k * r[t + k] for k in range(T - t)) + 0.9 ** (T - t) * last for t in range(T)
    ])
    assert_close(ret, expected)
