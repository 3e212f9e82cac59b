"""GAE with truncated importance weights (V-trace style), against the definition written out as sums."""

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
    """A_s = sum_{t >= s, same episode} gamma^(t-s) (prod_{s <= i < t} lam w_i) w_t delta_t, in float64."""
    T, N = r.shape
    adv = torch.zeros(T, N, dtype=torch.float64)
    for n in range(N):
        for s in range(T):
            total, trace = 0.0, 1.0
            for t in range(s, T):
                if term[t, n]:
                    nxt = 0.0
                elif trunc[t, n]:
                    nxt = float(fv[t, n])
                else:
                    nxt = float(last[n]) if t == T - 1 else float(v[t + 1, n])
                delta = float(r[t, n]) + gamma * nxt - float(v[t, n])
                total += gamma ** (t - s) * trace * float(w[t, n]) * delta
                if term[t, n] or trunc[t, n]:
                    break
                trace *= lam * float(w[t, n])
            adv[s, n] = total
    return adv


def test_unit_weights_are_plain_gae_bit_for_bit():
    r, v, term, trunc, fv, last, _ = _case()
    plain = compute_gae(r, v, term, trunc, fv, last, 0.99, 0.95)
    weighted = compute_gae(r, v, term, trunc, fv, last, 0.99, 0.95, weights=torch.ones_like(r))
    assert torch.equal(plain[0], weighted[0]) and torch.equal(plain[1], weighted[1])


def test_weights_scale_each_error_and_cut_the_trace_as_v_trace_says():
    r, v, term, trunc, fv, last, w = _case(seed=3)
    adv, ret = compute_gae(r, v, term, trunc, fv, last, 0.99, 0.95, weights=w)
    expected = vtrace_reference(r, v, term, trunc, fv, last, w, 0.99, 0.95)
    assert_close(adv.double(), expected, rtol=1e-5, atol=1e-5)
    assert_close(ret, adv + v)
    # A zero weight stops everything after it from reaching earlier samples.
    w0 = w.clone()
    w0[5] = 0.0
    cut, _ = compute_gae(r, v, term, trunc, fv, last, 0.99, 0.95, weights=w0)
    assert torch.equal(cut[5], torch.zeros(3))
    changed = r.clone()
    changed[6:] += 100.0
    cut_changed, _ = compute_gae(changed, v, term, trunc, fv, last, 0.99, 0.95, weights=w0)
    assert torch.equal(cut[:6], cut_changed[:6])
