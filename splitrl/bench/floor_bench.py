"""`splitrl bench floor`: what one iteration's work costs with nothing around it.

The parts of one PPO iteration of a run's settings, each timed alone in this process on one thread (or as a run
on more intra-op threads computes them: ``threads``), in CPU seconds (`time.process_time`), with the run's own
environment pipeline (`splitrl.stages.env_groups.training_envs`, the wrappers the edge steps) and its own network
(`splitrl.models.agent`, both halves), and no link, codec, storage or schedule around them:

- ``envs``: the iteration's env steps (``num_steps`` steps of ``num_envs`` envs), actions drawn at random in
  the policy's range and mapped onto the env's as the edge maps them;
- ``encoder acting`` / ``heads acting``: each step's forward of the encoder on that step's observations and of
  the heads on its features, with the action drawn, without a graph: a forward for each env group
  (``--rollout-groups``, batch ``num_envs`` / groups), as the pipelined schedule acts on each group apart;
- ``encoder training`` / ``heads training``: every minibatch of every epoch through the encoder and the heads,
  forward, PPO's loss, backward, the gradient's clipping to ``max_grad_norm`` and an Adam step on each side (the
  update's own maths: `Edge.optimizer_step`, `PPOUpdate.step`), the gradient handed across the cut as the split
  hands it (the encoder's part is its forward, its backward from that gradient, its clipping and its step).

The floor of an iteration is then the parts' sum over the cores that run them (every core busy all the time,
no part waiting for another: no schedule does better), and, for an edge and a server on machines of their own,
the larger of the two sides' sums. Benches print their rows' seconds against it (`splitrl bench pipeline`).
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..devices import acting_threads, intra_op_threads, place, update_threads
from ..envs import inspect_env
from ..models import agent
from ..ppo import adam, minibatch_schedule, ppo_loss
from ..settings import TrainSettings
from ..stages.env_groups import training_envs
from ..stages.rollouts import Groups

__all__ = ["PARTS", "EDGE_PARTS", "measure_floor", "acting_groups", "bracketed", "floor_table", "random_actions",
           "heads_update", "encoder_update"]

PARTS = ("envs", "encoder acting", "heads acting", "encoder training", "heads training")
EDGE_PARTS = ("envs", "encoder acting", "encoder training")
"""The parts an edge runs (stage0); the others run on the server (stage1)."""


class _Clock:
    """CPU seconds by part."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)

    @contextmanager
    def __call__(self, part: str) -> Iterator[None]:
        start = time.process_time()
        try:
            yield
        finally:
            self.seconds[part] += time.process_time() - start


def measure_floor(settings: TrainSettings, cores: int | None = None, channels_last: bool = False,
                  threads: int = 1) -> dict[str, Any]:
    """One iteration's parts for ``settings`` (`PARTS`, CPU seconds each), and the floors they imply on ``cores``
    cores (default: this machine's) and on an edge and a server of one core each; with ``channels_last``, the
    networks' convolutions as ``--channels-last`` runs them. ``threads``: torch's intra-op threads, one by default
    (the floor: the least CPU the parts take); with more, the parts as a run with ``--threads`` that many computes
    them (the forwards and backwards on all of them, the acting forwards and the optimizers' steps as the run
    threads them: `acting_threads`, `update_threads`), whose CPU above the floor's is the threads' own cost."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    with intra_op_threads(threads):
        seconds = _measure(settings, channels_last)
    return _implied(seconds, cores or os.cpu_count() or 1, settings.steps_per_iteration, channels_last, threads)


def acting_groups(settings: TrainSettings) -> int:
    """The env groups whose acting forwards ``settings``' parts take apart: ``--rollout-groups``, or one where it
    is 'auto' (what a run picks at no round trip)."""
    return settings.schedule.groups(settings.env.num_envs) or 1


def bracketed(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Two measurements of the same parts (`measure_floor`), one before a bench's runs and one after: each part's
    mean and the floors they imply, with ``bracket``, the two totals (how far the machine moved meanwhile)."""
    seconds = {part: (before["parts"][part] + after["parts"][part]) / 2 for part in PARTS}
    floor = _implied(seconds, before["cores"], before["steps"], before["channels_last"], before.get("threads", 1))
    return dict(floor, bracket=[before["total"], after["total"]])


def _implied(seconds: dict[str, float], cores: int, steps: int, channels_last: bool, threads: int = 1
             ) -> dict[str, Any]:
    edge = sum(seconds[p] for p in EDGE_PARTS)
    total = sum(seconds.values())
    return {"parts": seconds, "total": total, "edge": edge, "server": total - edge, "cores": cores,
            "floor": total / cores, "two_machines": max(edge, total - edge), "steps": steps,
            "channels_last": channels_last, "threads": threads}


def _measure(settings: TrainSettings, channels_last: bool) -> dict[str, float]:
    spec = inspect_env(settings.env)
    settings = settings.for_observation(spec.observation)  # the model and image pipeline the run would resolve
    ppo, n, clock = settings.ppo, settings.env.num_envs, _Clock()
    groups = Groups(n, acting_groups(settings)).slices
    cpu = torch.device("cpu")
    encoder, heads = (place(net, cpu, channels_last) for net in agent(settings, spec))
    encoder_params, heads_params = list(encoder.parameters()), list(heads.parameters())
    optimizers = [adam(p, lr=lr, fused=ppo.fused_adam) for p, lr in ((encoder_params, ppo.lr_encoder),
                                                                     (heads_params, ppo.lr_heads)) if p]
    generator = torch.Generator().manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    envs, _ = training_envs(settings)
    stacked = settings.env.image_pipeline[1] > 1
    observations, actions = [], []
    try:
        with clock("envs"):
            obs, _ = envs.reset(seed=settings.seed)
        for _ in range(ppo.num_steps):
            x = torch.as_tensor(spec.rows(obs, stacked))
            observations.append(x)
            for group in (x[rows] for rows in groups):
                with torch.no_grad(), acting_threads(cpu, len(group)):
                    with clock("encoder acting"):
                        features = encoder(group)
                    with clock("heads acting"):
                        actions.append(heads.evaluate(*heads.outputs(features), generator=generator)[0])
            with clock("envs"):
                obs, *_ = envs.step(spec.env_action(random_actions(spec, rng, n), settings.env.action_map))
    finally:
        envs.close()
    flat_obs, flat_actions = torch.cat(observations), torch.cat(actions)
    batch = len(flat_obs)
    advantages, returns = torch.randn(batch, generator=generator), torch.randn(batch, generator=generator)
    old_logprobs, old_values = torch.zeros(batch), torch.zeros(batch)
    for epoch in minibatch_schedule(settings.seed, 1, ppo.epochs, batch, ppo.minibatches):
        for idx in epoch:
            with clock("encoder training"):
                out = encoder(flat_obs[idx])
            with clock("heads training"):
                cut = out.detach().requires_grad_(out.requires_grad)
                heads_update(heads, heads_params, optimizers[-1], cut, ppo, flat_actions[idx], old_logprobs[idx],
                             advantages[idx], old_values[idx], returns[idx])
            if out.requires_grad:
                with clock("encoder training"):
                    encoder_update(encoder_params, optimizers[0], out, cut.grad, ppo)
    return clock.seconds


def random_actions(spec: Any, rng: np.random.Generator, n: int) -> np.ndarray:
    """``n`` actions drawn at random in the policy's range (indices, or values in [-1, 1]), for the edge to map
    onto the env's (`EnvSpec.env_action`)."""
    if spec.discrete:
        return rng.integers(0, spec.action_dim, n)
    return rng.uniform(-1.0, 1.0, (n, spec.action_dim)).astype(np.float32)


def heads_update(heads: nn.Module, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, cut: torch.Tensor,
                 ppo: Any, actions: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 old_values: torch.Tensor, returns: torch.Tensor) -> None:
    """The heads' part of one training minibatch on the features ``cut``: forward, PPO's loss, backward (into
    ``cut.grad`` where it needs one), the clipping and Adam's step on the CPU (`update_threads`)."""
    _, logprob, entropy, value = heads.evaluate(*heads.outputs(cut), actions)
    loss, _ = ppo_loss(logprob, old_logprobs, advantages, value.reshape(-1), old_values, returns, entropy,
                       clip_coef=ppo.clip_coef, vf_coef=ppo.vf_coef, ent_coef=ppo.ent_coef,
                       clip_vloss=ppo.clip_vloss, norm_adv=ppo.norm_adv)
    loss.backward()
    _clip_and_step(params, optimizer, ppo)


def encoder_update(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, out: torch.Tensor,
                   grad: torch.Tensor, ppo: Any) -> None:
    """The encoder's part of one training minibatch after its forward (``out``): the backward from the gradient
    the heads handed across the cut, the clipping and Adam's step on the CPU."""
    out.backward(grad)
    _clip_and_step(params, optimizer, ppo)


def _clip_and_step(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, ppo: Any) -> None:
    """Either side's update after its backward: the gradient clipped to ``max_grad_norm``, Adam's step (on the
    threads the run steps it on, `update_threads`), the gradients dropped."""
    with update_threads(torch.device("cpu")):
        nn.utils.clip_grad_norm_(params, ppo.max_grad_norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def floor_table(floor: dict[str, Any], rows: Sequence[tuple[str, float]] = ()) -> str:
    """Markdown: each part's CPU seconds and side, the floors; then each of ``rows`` ((name, seconds an
    iteration)) against the floor on this machine's cores."""
    lines = ["| part | side | CPU s / iteration |", "|---|---|---:|"]
    for part in PARTS:
        side = "edge" if part in EDGE_PARTS else "server"
        lines.append(f"| {part} | {side} | {floor['parts'][part]:.2f} |")
    lines += [
        f"| all parts | | {floor['total']:.2f} |",
        f"| floor on {floor['cores']} core{'s' if floor['cores'] > 1 else ''} (all parts / cores) | | "
        f"{floor['floor']:.2f} s |",
        f"| floor on an edge and a server of one core each (the larger side) | | {floor['two_machines']:.2f} s |",
    ]
    if floor.get("threads", 1) > 1:
        lines.append(f"| intra-op threads (the parts as a run on as many computes them) | | {floor['threads']} |")
    if "bracket" in floor:
        lines.append("| all parts, timed before and after the runs (their mean above) | | "
                     + " and ".join(f"{total:.2f}" for total in floor["bracket"]) + " |")
    if rows:
        lines += ["", "| run | s / iteration | x floor |", "|---|---:|---:|"]
        lines += [f"| {name} | {seconds:.1f} | {seconds / floor['floor']:.2f}x |" for name, seconds in rows]
    return "\n".join(lines)
