"""PPO's Adam steps all its tensors at once and computes what the one-tensor-at-a-time loop computes."""

import torch

from splitrl.ppo import adam


def test_the_multi_tensor_adam_is_the_one_tensor_loop_bit_for_bit():
    """The heads' shapes (a 4096-wide cut, two heads of 512) and a log-std with its own rate, 30 steps of gradients
    of every scale: every parameter and every moment equal to torch's CPU default (``foreach=False``)."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(512, 4096), (512,), (1, 512), (1,), (512, 4096), (512,), (3, 512), (3,)]
    start = [torch.randn(s, generator=generator) for s in shapes]
    spread = torch.full((3,), -0.5)
    grads = [[torch.randn(s, generator=generator) * 10.0 ** (k % 7 - 3) for s in [*shapes, (3,)]] for k in range(30)]

    def run(make):
        params = [torch.nn.Parameter(t.clone()) for t in [*start, spread]]
        optimizer = make([{"params": params[:-1]}, {"params": params[-1:], "lr": 3e-4}])
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            optimizer.step()
        return params, optimizer.state_dict()["state"]

    ours, ours_state = run(lambda groups: adam(groups, lr=1e-5))
    loop, loop_state = run(lambda groups: torch.optim.Adam(groups, lr=1e-5, eps=1e-5, foreach=False))
    assert all(torch.equal(a, b) for a, b in zip(ours, loop))
    for k in loop_state:
        assert all(torch.equal(ours_state[k][m], loop_state[k][m]) for m in ("exp_avg", "exp_avg_sq", "step"))
    assert not torch.equal(ours[0], start[0])  # it stepped


def test_the_fused_adam_stays_within_a_rounding_of_each_step():
    """``--fused-adam`` computes each step in one pass: not the default's bits (the multi-tensor update, which is
    the loop's: above), but after 200 steps of gradients of every scale no tensor's largest difference from the
    default's exceeds 1 % of that tensor's largest movement (plus 1e-7, a few ulps of parameters near 1)."""
    generator = torch.Generator().manual_seed(1)
    shapes = [(512, 4096), (512,), (3, 512), (3,)]
    start = [torch.randn(s, generator=generator) for s in shapes]
    grads = [[torch.randn(s, generator=generator) * 10.0 ** (k % 7 - 3) for s in shapes] for k in range(200)]

    def run(fused):
        params = [torch.nn.Parameter(t.clone()) for t in start]
        optimizer = adam(params, lr=1e-5, fused=fused)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            optimizer.step()
        return params

    fused, loop = run(True), run(False)
    for f, l, s in zip(fused, loop, start):
        moved = float((l.detach() - s).abs().max())
        assert moved > 1e-5 and float((f.detach() - l.detach()).abs().max()) <= 0.01 * moved + 1e-7
    assert any(not torch.equal(f, l) for f, l in zip(fused, loop))  # not the same bits: an option, not the default


def test_a_checkpoints_adam_state_loads_into_the_kernel_the_run_was_built_with():
    """A checkpoint written by torch's default (``foreach`` None) or by a fused run carries its kernel in its
    groups; loading keeps the optimizer's own, and the moments."""
    from splitrl.ppo import load_adam_state

    params = [torch.nn.Parameter(torch.ones(4))]
    old = torch.optim.Adam(params, lr=1e-3, eps=1e-5)  # as a checkpoint from before splitrl chose the kernel
    params[0].grad = torch.full((4,), 0.5)
    old.step()
    saved = old.state_dict()
    assert saved["param_groups"][0]["foreach"] is None
    ours = adam(params, lr=1e-3)
    load_adam_state(ours, saved)
    assert ours.param_groups[0]["foreach"] is True and ours.param_groups[0]["lr"] == 1e-3
    assert torch.equal(ours.state[params[0]]["exp_avg"], saved["state"][0]["exp_avg"])
