"""GAE with truncated importance weights (V-trace style), against the definitions written out as sums."""

import torch
from torch.testing import assert_close

from splitrl.ppo.gae import compute_gae


def _case(seed=0, T=12, N=3):
    g = torch.Generator().manual_seed(seed)
    r, v = torch.randn(T, N, generator=g), torch.randn(T, N, generator=g)
    term = torch.rand(T, N, generator=g) < 0.1
    trunc = (torch.rand(T, N, generator=g) < 0.1) & ~term
    fv, last = torch.randn(T, N, generator=g), torch.randn(N, generator=g)
    w = torch.rand(T, N, generator=g).clamp(min=0.05)
    return r, v, term, trunc, fv, last, w


def vtrace_reference(r, v, term, trunc, fv, last, w, gamma, lam):
    """(policy advantages, value targets), in float64, from the definitions:

    v_s - V_s = sum_{t >= s, same episode} gamma^(t-s) (prod_{s <= i < t} lam w_i) w_t delta_t   (V-trace)
    A_s = delta_s + gamma lam (v_{s+1} - V_{s+1})   (0 after the episode's last step)
    """
    T, N = r.shape
    deltas = torch.zeros(T, N, dtype=torch.float64)
    ends = torch.zeros(T, N, dtype=torch.bool)
    for n in range(N):
        for t in range(T):
            if term[t, n]:
                nxt = 0.0
            elif trunc[t, n]:
                nxt = float(fv[t, n])
            else:
                nxt = float(last[n]) if t == T - 1 else float(v[t + 1, n])
            deltas[t, n] = float(r[t, n]) + gamma * nxt - float(v[t, n])
            ends[t, n] = bool(term[t, n] or trunc[t, n]) or t == T - 1
    excess = torch.zeros(T, N, dtype=torch.float64)  # v_s - V_s
    for n in range(N):
        for s in range(T):
            total, trace = 0.0, 1.0
            for t in range(s, T):
                total += gamma ** (t - s) * trace * float(w[t, n]) * float(deltas[t, n])
                if ends[t, n]:
                    break
                trace *= lam * float(w[t, n])
            excess[s, n] = total
    adv = deltas.clone()
    for n in range(N):
        for s in range(T - 1):
            if not ends[s, n]:
                adv[s, n] += gamma * lam * excess[s + 1, n]
    return adv, excess + v.double()


def test_unit_weights_are_plain_gae_bit_for_bit():
    r, v, term, trunc, fv, last, _ = _case()
    plain = compute_gae(r, v, term, trunc, fv, last, 0.99, 0.95)
    weighted = compute_gae(r, v, term, trunc, fv, last, 0.99, 0.95, weights=torch.ones_like(r))
    assert torch.equal(plain[0], weighted[0]) and torch.equal(plain[1], weighted[1])


def test_weights_scale_each_error_and_cut_the_trace_as_v_trace_says():
    r, v, term, trunc, fv, last, w = _case(seed=3)
    adv, ret = compute_gae(r, v, term, trunc, fv, last, 0.99, 0.95, weights=w)
    expected_adv, expected_ret = vtrace_reference(r, v, term, trunc, fv, last, w, 0.99, 0.95)
    assert_close(adv.double(), expected_adv, rtol=1e-5, atol=1e-5)
    assert_close(ret.double(), expected_ret, rtol=1e-5, atol=1e-5)
    # The weights matter, and differently for the two: targets weight step t's own error, advantages do not.
    plain_adv, plain_ret = compute_gae(r, v, term, trunc, fv, last, 0.99, 0.95)
    assert not torch.allclose(adv, plain_adv) and not torch.allclose(ret, plain_ret)
    assert not torch.allclose(ret - v, adv)
    # A zero weight stops everything after it from reaching earlier samples' targets and advantages.
    w0 = w.clone()
    w0[5] = 0.0
    cut_adv, cut_ret = compute_gae(r, v, term, trunc, fv, last, 0.99, 0.95, weights=w0)
    assert torch.equal(cut_ret[5], v[5])
    changed = r.clone()
    changed[6:] += 100.0
    changed_adv, changed_ret = compute_gae(changed, v, term, trunc, fv, last, 0.99, 0.95, weights=w0)
    assert torch.equal(cut_ret[:6], changed_ret[:6]) and torch.equal(cut_adv[:5], changed_adv[:5])
