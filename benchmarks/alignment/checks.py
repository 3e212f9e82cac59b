"""The invariants (a) to (f) (benchmarks/async_probe.py says each), checked on what the probe recorded.

Each check raises `InvariantBroken` at the first sample that breaks it, naming the iteration, the (t, env) and
the numbers; the counts of what it checked go to the run's `Tally`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from splitrl.envs import to_chw
from splitrl.ppo import compute_gae

from .errors import broken
from .record import Record, weights_differ
from .summary import Tally

__all__ = ["ATOL", "RTOL", "check_behaviour", "check_neighbours", "check_observations", "check_observations_kept",
           "check_outcomes", "check_rescore", "check_start", "check_training", "check_versions"]

ATOL = RTOL = 1e-5
"""fp32 numbers recomputed in other batch shapes agree to this (|a - b| <= ATOL + RTOL |b|)."""


def _close(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a - b).abs() <= ATOL + RTOL * b.abs()


def check_observations(rec: Record, i: int, flat_obs: torch.Tensor) -> None:
    """(a): the rows training forwards are the env's observations, (t, env) by (t, env)."""
    T, N = rec.run.settings.ppo.num_steps, rec.run.settings.env.num_envs
    expected = rec.env.rollout_obs(i)
    stored = flat_obs.view((T, N) + tuple(flat_obs.shape[1:]))
    for t in range(T):
        for env in range(N):
            if torch.equal(stored[t, env], expected[t, env]):
                continue
            diff = (stored[t, env].int() - expected[t, env].int()).abs()
            near = [f"the env's at t{d:+d}" for d in (-1, 1)
                    if 0 <= t + d < T and torch.equal(stored[t, env], expected[t + d, env])]
            raise broken("a", "observations", i, f"(t={t}, env={env})",
                         f"the stored observation differs from the env's in {int((diff > 0).sum())} of "
                         f"{diff.numel()} pixels (mean |diff| {float(diff.float().mean()):.3g})"
                         + (f"; it equals {near[0]}" if near else ""))


def check_outcomes(rec: Record, i: int, buf: Any, wire: Any) -> None:
    """(b): the env was given the stored action at t (through ``wire``, the heads' action on the wire), and what
    it returned is stored at t."""
    T, spec, env_steps = rec.run.settings.ppo.num_steps, rec.env.spec, rec.env.steps
    for t in range(T):
        for g, rows in enumerate(rec.env.groups):
            step = env_steps[g][(i - 1) * T + t]
            given = spec.env_action(wire(buf.actions[t, rows]).numpy(), rec.run.settings.env.action_map)
            for j, env in enumerate(rows):
                where = f"(t={t}, env={env})"
                if not np.allclose(step.action[j], given[j], rtol=0, atol=1e-6):
                    raise broken("b", "outcomes", i, where, f"the env was given action {step.action[j].tolist()}, "
                                 f"the stored action maps to {given[j].tolist()}")
                for name, kept in (("reward", buf.rewards), ("terminated", buf.terminated),
                                   ("truncated", buf.truncated)):
                    returned = float(getattr(step, name)[j])
                    if float(kept[t, env]) != returned:
                        around = ", ".join(
                            f"{float(getattr(env_steps[g][(i - 1) * T + t + d], name)[j]):.7g} at t{d:+d}"
                            for d in (-1, 1) if 0 <= t + d < T)
                        raise broken("b", "outcomes", i, where, f"stage1 stored {name} {float(kept[t, env]):.7g}, "
                                     f"the env returned {returned:.7g} for the action at t ({around})")


def check_behaviour(rec: Record, tally: Tally, i: int, learner: Any, slot: int) -> None:
    """(c): each sample's stored behaviour is its version's on the stored observation and action."""
    T, frozen = rec.run.settings.ppo.num_steps, rec.versions
    buf, versions = learner.train_buffer, learner.rollouts.versions.items[slot]
    obs = rec.env.rollout_obs(i)
    # Per sample and quantity: (recomputed, stored, within tolerance); features by their largest difference.
    got = {name: torch.zeros(versions.shape) for name in ("features", "logprob", "value")}
    kept = {"features": torch.zeros(versions.shape), "logprob": buf.logprobs, "value": buf.values}
    ok = {name: torch.ones(versions.shape, dtype=torch.bool) for name in got}
    for v in (int(v) for v in versions.unique()):
        at = versions == v
        features, logprob, value = frozen.behaviour(v, obs[at], buf.actions[at])
        if learner.rollouts.inputs is not None:
            stored = learner.rollouts.inputs.items[slot][at]
            got["features"][at] = (features - stored).abs().amax(1)
            ok["features"][at] = _close(features, stored).all(1)
        got["logprob"][at], ok["logprob"][at] = logprob, _close(logprob, buf.logprobs[at])
        got["value"][at], ok["value"][at] = value, _close(value, buf.values[at])
        neighbour = v + 1 if v + 1 <= (i - 1) * rec.run.per_iteration else v - 1
        if neighbour >= 0:  # would another version's weights have passed? then the check tells nothing
            other = frozen.behaviour(neighbour, obs[at], buf.actions[at])[1]
            tally.neighbour_tried += int(at.sum())
            tally.neighbour_differs += int((~_close(other, buf.logprobs[at])).sum())
    for name in got:
        tally.max_err[name] = max(tally.max_err[name], float((got[name] - kept[name]).abs().max()))
    for name, what in (("features", "stored features"), ("logprob", "behaviour log-prob"), ("value", "value")):
        if bool(ok[name].all()):
            continue
        t, env = (int(x) for x in (~ok[name]).nonzero()[0])
        v = int(versions[t, env])
        if name == "features":
            detail = (f"stage1's stored features differ by up to {float(got[name][t, env]):.3g} from version "
                      f"{v}'s encoder on the observation")
        else:
            detail = (f"stage1 stored {float(kept[name][t, env]):.7g}; version {v}'s encoder and heads give "
                      f"{float(got[name][t, env]):.7g} on the stored observation and action")
        raise broken("c", what, i, f"(t={t}, env={env})", detail)
    # The bootstrap values: the last observation's, and each truncated episode's real last one's.
    stacked = rec.run.settings.env.image_pipeline[1] > 1
    for g, rows in enumerate(rec.env.groups):
        v = rec.s1_ends[(i, g)]
        value = frozen.value(v, rec.env.obs(g, i * T))
        for j, env in enumerate(rows):
            _bootstrap(tally, i, f"(t={T}, env={env})", "last value", v, value[j],
                       learner.rollouts.last_values.items[slot][env])
        for t in range(T):
            step = rec.env.steps[g][(i - 1) * T + t]
            for j, env in enumerate(rows):
                if j not in step.final_obs:
                    if float(buf.final_values[t, env]) != 0.0:
                        raise broken("c", "bootstrap value", i, f"(t={t}, env={env})",
                                     f"stage1 stored final value {float(buf.final_values[t, env]):.7g} where the "
                                     "env did not truncate")
                    continue
                # The real last observation rides on the next message: that message's version scores it.
                w = int(versions[t + 1, env]) if t + 1 < T else v
                final = torch.as_tensor(to_chw(step.final_obs[j][None], stacked))
                _bootstrap(tally, i, f"(t={t}, env={env})", "final value", w, frozen.value(w, final)[0],
                           buf.final_values[t, env])
                tally.truncations += 1


def _bootstrap(tally: Tally, i: int, where: str, what: str, version: int, got: torch.Tensor,
               kept: torch.Tensor) -> None:
    tally.max_err["bootstrap"] = max(tally.max_err["bootstrap"], float((got - kept).abs()))
    if not bool(_close(got, kept)):
        raise broken("c", "bootstrap value", i, where, f"stage1 stored {what} {float(kept):.7g}; version "
                     f"{version}'s encoder and heads give {float(got):.7g}")


def check_neighbours(tally: Tally, n: int) -> None:
    """(c) over the whole run of ``n`` iterations: a neighbouring version failed to reproduce some stored
    log-prob, or matching the recorded version would tell nothing."""
    if tally.neighbour_differs == 0:
        raise broken("c", "behaviour", n, "the whole run", f"no neighbouring version's log-prob differed from the "
                     f"stored one on any of {tally.neighbour_tried} samples: the check cannot tell versions apart")


def check_start(rec: Record, stage: str, i: int, live: torch.nn.Module) -> None:
    """(d): iteration ``i`` trains ``stage``'s layers from version (i - 1) P, exactly as training left them."""
    start = (i - 1) * rec.run.per_iteration
    differs = weights_differ(live, rec.versions.trained(stage)[start])
    if differs:
        layers = (f"stage0's encoder is not version {start} as training left it" if stage == "stage0" else
                  f"stage1's heads are not version {start} as training left them")
        raise broken("d", "versions", i, "the start of training", f"{layers}: {differs}")


def check_versions(rec: Record, tally: Tally, i: int, versions: torch.Tensor) -> None:
    """(d): tag, encoder, heads and stored version agree at every step; lags within the bound."""
    T, P, bound = rec.run.settings.ppo.num_steps, rec.run.per_iteration, rec.run.bound
    for g, rows in enumerate(rec.env.groups):
        seen = set()
        for t in [*range(T), "end"]:
            if t == "end":
                (tag, encoded), acted, stored = rec.s0_ends[(i, g)], rec.s1_ends[(i, g)], None
                where = f"(rollout_end, group {g})"
            else:
                (tag, encoded), acted = rec.s0_steps[(i, t, g)], rec.s1_steps[(i, t, g)]
                stored = {int(versions[t, env]) for env in rows}
                where = f"(t={t}, env={rows[0]})"
            if P > 1:  # --publish epoch: step t acts after floor(t P / T) epochs of i - 1
                paced = max(0, (i - 2) * P + (T - 1 if t == "end" else t) * P // T)
                if tag != paced:
                    raise broken("d", "versions", i, where, f"stage0 tagged the step with version {tag}, the "
                                 f"pace says {paced}")
            if tag is not None and tag != encoded:
                raise broken("d", "versions", i, where, f"stage0 tagged the step with version {tag} and encoded "
                             f"it with version {encoded}")
            if acted != encoded:
                raise broken("d", "versions", i, where, f"stage0 encoded the step with version {encoded}, "
                             f"stage1's heads of version {acted} acted on it")
            if stored is not None and stored != {acted}:
                raise broken("d", "versions", i, where, f"stage1 stored version(s) {sorted(stored)} for a step "
                             f"its heads of version {acted} acted on")
            lag = (i - 1) * P - acted
            if not 0 <= lag <= bound * P:
                raise broken("d", "versions", i, where, f"version {acted} lags {lag}, outside [0, {bound * P}]")
            if t != "end":
                tally.lags[lag] += len(rows)
            seen.add(acted)
        tally.swaps += len(seen) > 1


def check_observations_kept(rec: Record, i: int, stored: torch.Tensor, before: torch.Tensor) -> None:
    """(e) on stage0: its stored observations did not change while it trained on them."""
    if not torch.equal(stored, before):
        row = int((stored != before).reshape(len(stored), -1).any(1).nonzero()[0])
        N = rec.run.settings.env.num_envs
        raise broken("e", "training data", i, f"(t={row // N}, env={row % N})",
                     "stage0's stored observation changed while it trained on it")


def check_training(rec: Record, i: int, learner: Any, slot: int, before: dict[str, torch.Tensor]) -> None:
    """(e): one minibatch order on both stages; stage1's trained slot (``before`` as training began) did not
    change while it trained. Called after stage1's last optimizer step: stage0 forwarded every part before
    stage1 could take it."""
    N, s0, s1 = rec.run.settings.env.num_envs, rec.training["stage0"], rec.training["stage1"]
    for name in ("schedule", "parts"):
        kept0, kept1 = (s0.schedules[i], s1.schedules[i]) if name == "schedule" else (s0.parts[i], s1.parts[i])
        flat0 = [p for part in kept0 for p in (part if name == "schedule" else [part])]
        flat1 = [p for part in kept1 for p in (part if name == "schedule" else [part])]
        if len(flat0) != len(flat1):
            raise broken("e", "training data", i, "training", f"stage0's {name} has {len(flat0)} minibatches, "
                         f"stage1's {len(flat1)}")
        for k, (a, b) in enumerate(zip(flat0, flat1)):
            if not torch.equal(a, b):
                raise broken("e", "training data", i, f"minibatch {k} of the {name}", f"stage0 trains on samples "
                             f"{a[:6].tolist()}..., stage1 on {b[:6].tolist()}...")
    if not torch.equal(torch.cat(s0.parts[i]), torch.cat([mb for e in s0.schedules[i] for mb in e])):
        raise broken("e", "training data", i, "training", "stage0 did not train on its schedule's samples in order")
    buf = learner.train_buffer
    now = {name: getattr(buf, name) for name in before if hasattr(buf, name)}
    now.update(versions=learner.rollouts.versions.items[slot], last_values=learner.rollouts.last_values.items[slot])
    if learner.rollouts.inputs is not None:
        now["inputs"] = learner.rollouts.inputs.items[slot]
    for name, was in before.items():
        if not torch.equal(now[name], was):
            changed = (now[name] != was).reshape(was.shape[0], -1).any(1).nonzero()[0].item() \
                if name != "last_values" else 0
            where = "(t=T, all envs)" if name == "last_values" else f"(t={changed}, row of {N} envs)"
            raise broken("e", "training data", i, where, f"stage1's stored {name} changed while it trained")


def check_rescore(rec: Record, tally: Tally, i: int, learner: Any, slot: int) -> None:
    """(f): ``--rescore``'s baseline and proximal policy are version i - 1's on every sample."""
    obs, buf = rec.env.rollout_obs(i), learner.train_buffer
    flat_obs = obs.reshape((-1,) + tuple(obs.shape[2:]))
    start = (i - 1) * rec.run.per_iteration
    _, logprob, value = rec.versions.behaviour(start, flat_obs, buf.b_actions)
    value, lagging = value.reshape(-1), learner.decoupled.lagging
    wanted = [("baseline value", buf.b_values, value)]
    if learner.decoupled.proximal is not None:  # samples lag: their proximal policy is the one that starts training
        wanted.append(("proximal log-prob", learner.decoupled.proximal[lagging], logprob[lagging]))
    # The value targets: GAE on that baseline, weighted where samples lag by min(1, pi_{i-1} / mu).
    shape, ppo = buf.values.shape, rec.run.settings.ppo
    weights = torch.where(lagging, (logprob - buf.b_logprobs).exp().clamp(max=1.0), torch.ones_like(logprob))
    _, returns = compute_gae(buf.rewards, value.reshape(shape), buf.terminated, buf.truncated, buf.final_values,
                             learner.rollouts.last_values.items[slot], ppo.gamma, ppo.gae_lambda,
                             weights.reshape(shape) if bool(lagging.any()) else None)
    wanted.append(("value target", buf.b_returns, returns.reshape(-1)))
    for what, kept, got in wanted:
        ok = _close(kept, got)
        tally.max_err[what] = max(tally.max_err.get(what, 0.0), float((kept - got).abs().max()))
        if not bool(ok.all()):
            k = int((~ok).nonzero()[0])
            raise broken("f", what, i, f"(sample {k})", f"stage1 trains with {float(kept[k]):.7g}; version {start}'s "
                         f"encoder and heads give {float(got[k]):.7g} on the stored observation and action")
    tally.checked["rescored rollouts"] += 1
