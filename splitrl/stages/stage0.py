"""Stage0: the environments and the layers before the cut. It drives the session."""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from ..codecs import CodecSet, Context, HeadsSync
from ..envs import EnvSpec, make_vector_env, to_chw, to_env_action
from ..models import build_agent
from ..ppo import minibatch_schedule
from ..settings import TrainSettings
from ..transport import Message, ProtocolError, Transport
from ..transport.handshake import handshake
from .protocol import STAGE0, STAGE1
from ..runs import RunLog

__all__ = ["Stage0", "EMA_DECAY"]

log = logging.getLogger(__name__)

EMA_DECAY = 0.9
"""The paper smooths episodic returns with an EMA of this decay, one update per episode."""


class _Clock:
    """Accumulates wall time per phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - since
        return now


class Stage0:
    """Environments + the stage0 part of the network; runs rollouts and training
    over a `Transport` to stage1, and writes the run directory."""

    def __init__(self, settings: TrainSettings, spec: EnvSpec, run_log: RunLog, *, checkpoint_every: int = 10) -> None:
        self.settings, self.spec, self.run_log = settings, spec, run_log
        self.checkpoint_every = checkpoint_every
        self.net, heads = build_agent(spec.obs_shape, spec.action_dim, settings.cut, settings.seed, settings.ppo.init_log_std)
        params = list(self.net.parameters())
        self.optimizer = torch.optim.Adam(params, lr=settings.ppo.lr_encoder, eps=1e-5) if params else None
        n, t = settings.env.num_envs, settings.ppo.num_steps
        self.obs = torch.zeros((t, n) + spec.obs_shape, dtype=torch.uint8)
        self.low = np.array(spec.action_low)
        self.high = np.array(spec.action_high)
        self.stacked = settings.env.frame_stack > 1
        self.global_step = 0
        self.ema_return: float | None = None
        self.clock = _Clock()
        self.codecs = CodecSet(**settings.codecs.specs())
        self.all_envs = torch.arange(n)
        # With the replica codec: the heads as stage1 last sent them (never trained here).
        replica = self.codecs.replica
        self.replica_heads = heads.requires_grad_(False) if replica is not None else None
        self.heads_sync = HeadsSync(heads.replicated(), replica.sync) if replica is not None else None
        self.view_outputs: torch.Tensor | None = None

    # -- pieces ----------------------------------------------------------------------
    def _encode(self, obs: np.ndarray | torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        with torch.no_grad():
            out = self.net(torch.as_tensor(obs))
        self.clock.add("encoder", start)
        return out

    def _exchange(self, link: Transport, kind: str, tensors: dict[str, torch.Tensor], header: dict[str, Any], expect: str | None) -> Message | None:
        start = time.perf_counter()
        link.send(kind, tensors, header)
        msg = link.recv() if expect else None
        self.clock.add("link", start)
        if msg is not None and msg.kind != expect:
            raise ProtocolError(f"stage0: after {kind!r} expected {expect!r}, got {msg.kind!r}")
        return msg

    def _outcome(self, reward, terminated, truncated, info) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The previous step's outcome: (tensors, header) to ride on the next message."""
        out = {
            "reward": torch.as_tensor(reward, dtype=torch.float32),
            "terminated": torch.as_tensor(terminated, dtype=torch.bool),
            "truncated": torch.as_tensor(truncated, dtype=torch.bool),
        }
        header: dict[str, Any] = {}
        bootstrap = np.flatnonzero(np.asarray(truncated) & ~np.asarray(terminated))
        if len(bootstrap):
            final = np.stack([info["final_obs"][i] for i in bootstrap])
            index = torch.as_tensor(bootstrap, dtype=torch.int64)
            # Packed before the step's own features: stateful codecs see each env's frames in order.
            ctx = Context(envs=index, global_step=self.global_step)
            self.codecs.pack("rollout", "final_features", self._encode(to_chw(final, self.stacked)), ctx, out, header)
            out["final_index"] = index
        return out, header

    def _episodes(self, info: dict[str, Any], iteration: int, returns: list[float]) -> None:
        if "episode" not in info:
            return
        for i in np.flatnonzero(info["_episode"]):
            r, length = float(info["episode"]["r"][i]), int(info["episode"]["l"][i])
            self.ema_return = r if self.ema_return is None else EMA_DECAY * self.ema_return + (1 - EMA_DECAY) * r
            returns.append(r)
            self.run_log.episode(
                {"global_step": self.global_step, "iteration": iteration, "env": int(i), "return": r,
                 "length": length, "ema_return": self.ema_return}
            )

    # -- phases ----------------------------------------------------------------------
    def rollout(self, link: Transport, envs, next_obs: np.ndarray, iteration: int, returns: list[float]) -> np.ndarray:
        n = self.settings.env.num_envs
        tensors: dict[str, torch.Tensor] = {}
        header: dict[str, Any] = {}
        self.codecs.new_iteration()
        for t in range(self.settings.ppo.num_steps):
            obs = torch.as_tensor(to_chw(next_obs, self.stacked))
            self.obs[t] = obs
            ctx = Context(idx=t * n + self.all_envs, envs=self.all_envs, global_step=self.global_step)
            self.codecs.pack("rollout", "features", self._encode(obs), ctx, tensors, header)
            msg = self._exchange(link, "step", tensors, {**header, "t": t}, "action")
            action = msg.tensors.get("action")
            if action is None or tuple(action.shape) != (self.settings.env.num_envs, self.spec.action_dim):
                raise ProtocolError(f"action: expected a tensor 'action' of shape {[self.settings.env.num_envs, self.spec.action_dim]}")
            env_action = to_env_action(action.float().numpy(), self.low, self.high, self.settings.env.action_map)
            start = time.perf_counter()
            next_obs, reward, terminated, truncated, info = envs.step(env_action)
            self.clock.add("env", start)
            self.global_step += self.settings.env.num_envs
            self._episodes(info, iteration, returns)
            tensors, header = self._outcome(reward, terminated, truncated, info)
        ctx = Context(envs=self.all_envs, global_step=self.global_step)
        self.codecs.pack("rollout", "features", self._encode(to_chw(next_obs, self.stacked)), ctx, tensors, header)
        if self.replica_heads is None:
            self._exchange(link, "rollout_end", tensors, header, None)
        else:
            msg = self._exchange(link, "rollout_end", tensors, header, "heads")
            self._sync_replica(msg, iteration, n * self.settings.ppo.num_steps)
        return next_obs

    def _sync_replica(self, msg: Message, iteration: int, samples: int) -> None:
        """Update the heads' replica, then its outputs on every sample's rollout view."""
        start = time.perf_counter()
        self._update_replica(msg, {"iteration": iteration})
        with torch.no_grad():
            self.view_outputs = torch.cat([self.replica_heads.outputs(self._view_rows(idx))
                                           for idx in torch.arange(samples).split(1024)])
        self.clock.add("codec", start)

    def _update_replica(self, msg: Message, expected: dict[str, int], names: list[str] | None = None) -> None:
        """Check that ``msg`` is the update ``expected`` names, apply it to the view, copy that into the replica."""
        got = {key: msg.header.get(key) for key in expected}
        if got != expected:
            raise ProtocolError(f"heads: expected the update for {expected}, got {got}")
        view = self.heads_sync.decode(msg.tensors, names)
        with torch.no_grad():
            for name, p in self.replica_heads.replicated():
                p.copy_(view[name])

    def _view_rows(self, idx: torch.Tensor) -> torch.Tensor:
        return self.codecs.replica.view_rows(idx, self.replica_heads.critic[0].in_features)

    def train(self, link: Transport, iteration: int) -> None:
        if self.optimizer is None:
            return  # nothing of ours to train: stage1 trains alone on what it received
        ppo = self.settings.ppo
        flat = self.obs.reshape((-1,) + self.spec.obs_shape)
        schedule = minibatch_schedule(self.settings.seed, iteration, ppo.epochs, flat.shape[0], ppo.minibatches)
        params = list(self.net.parameters())
        for epoch, minibatches in enumerate(schedule):
            for mb, idx in enumerate(minibatches):
                start = time.perf_counter()
                features = self.net(flat[idx])
                start = self.clock.add("encoder", start)
                tensors: dict[str, torch.Tensor] = {}
                header: dict[str, Any] = {"epoch": epoch, "mb": mb}
                ctx = Context(idx=idx, global_step=self.global_step)
                if self.replica_heads is None:
                    sent, name = features, "features"
                    seen = self.codecs.pack("fwd", name, features.detach(), ctx, tensors, header)
                else:  # the change of the heads' outputs since the rollout, through the replica
                    sent, name = self.replica_heads.outputs(features), "outputs"
                    self.codecs.pack("fwd", name, sent.detach() - self._view_outputs(idx), ctx, tensors, header)
                    seen = None
                self.clock.add("codec", start)
                msg = self._exchange(link, "train_fwd", tensors, header, "train_bwd")
                start = time.perf_counter()
                ctx = Context(idx=idx, mask=None if seen is None else seen != 0, global_step=self.global_step)
                grad = self.codecs.unpack("bwd", "grad", msg.tensors, msg.header, ctx, tuple(sent.shape), sent.dtype)
                start = self.clock.add("codec", start)
                self.optimizer.zero_grad(set_to_none=True)
                torch.autograd.backward(sent, grad)
                nn.utils.clip_grad_norm_(params, ppo.max_grad_norm)
                self.optimizer.step()
                self.clock.add("encoder", start)
                if self.replica_heads is not None:
                    self._sync_replica_midway(link, iteration, epoch, mb)

    def _view_outputs(self, idx: torch.Tensor) -> torch.Tensor:
        """The replica's outputs on the rollout view of samples ``idx``: cached for the
        whole view after the rollout's update, computed per minibatch after a later one."""
        if self.view_outputs is not None:
            return self.view_outputs[idx]
        with torch.no_grad():
            return self.replica_heads.outputs(self._view_rows(idx))

    def _sync_replica_midway(self, link: Transport, iteration: int, epoch: int, mb: int) -> None:
        """Receive and apply the update that follows this minibatch's gradient, if one is due."""
        ppo = self.settings.ppo
        due = self.codecs.replica.due(epoch, mb, ppo.epochs, ppo.minibatches, self.heads_sync.view)
        if not due:
            return
        start = time.perf_counter()
        msg = link.recv()
        start = self.clock.add("link", start)
        if msg.kind != "heads":
            raise ProtocolError(f"stage0: after 'train_bwd' of minibatch {(epoch, mb)} expected 'heads', got {msg.kind!r}")
        self._update_replica(msg, {"iteration": iteration, "epoch": epoch, "mb": mb}, due)
        self.view_outputs = None  # stale now; `_view_outputs` computes what each minibatch needs
        self.clock.add("codec", start)

    def finish_iteration(self, link: Transport, iteration: int, checkpoint: bool) -> dict[str, Any]:
        start = time.perf_counter()
        link.send("iter_end", header={"iteration": iteration, "checkpoint": checkpoint})
        while True:
            msg = link.recv()
            if msg.kind == "iter_stats":
                break
            if msg.kind != "progress":
                raise ProtocolError(f"stage0: after 'iter_end' expected 'progress' or 'iter_stats', got {msg.kind!r}")
        self.clock.add("link", start)
        if checkpoint:
            self.run_log.checkpoint(STAGE0, iteration, self.state_dict(iteration))
        return dict(msg.header)

    def state_dict(self, iteration: int) -> dict[str, Any]:
        return {
            "iteration": iteration,
            "net": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer else None,
        }

    # -- the whole session -----------------------------------------------------------
    def run(self, link: Transport, *, start_timeout: float | None = None) -> list[dict[str, Any]]:
        """Handshake, train for every iteration, close. Returns the metrics records."""
        s = self.settings
        try:
            handshake(link, STAGE0, STAGE1, s.shared(), timeout=start_timeout)
            envs = make_vector_env(s.env, reward_gamma=s.ppo.gamma if s.ppo.norm_reward else None, reward_clip=s.ppo.reward_clip)
            try:
                records = self._train_loop(link, envs)
            finally:
                envs.close()
            link.send("close")
        except BaseException as exc:
            link.abort(f"stage0 failed: {type(exc).__name__}: {exc}")
            raise
        return records

    def _train_loop(self, link: Transport, envs) -> list[dict[str, Any]]:
        s = self.settings
        next_obs, _ = envs.reset(seed=s.seed)
        records = []
        bytes_before = link.meter.snapshot()
        run_start = time.perf_counter()
        for iteration in range(1, s.num_iterations + 1):
            self.clock = _Clock()
            iter_start = time.perf_counter()
            cpu_start = time.process_time()
            returns: list[float] = []
            next_obs = self.rollout(link, envs, next_obs, iteration, returns)
            self.train(link, iteration)
            last = iteration == s.num_iterations
            checkpoint = last or (self.checkpoint_every > 0 and iteration % self.checkpoint_every == 0)
            stats = self.finish_iteration(link, iteration, checkpoint)
            wall = time.perf_counter() - iter_start
            net_now = link.meter.snapshot()
            record: dict[str, Any] = {
                "iteration": iteration,
                "global_step": self.global_step,
                "charts/episodic_return": sum(returns) / len(returns) if returns else None,
                "charts/episodic_return_ema": self.ema_return,
                "charts/episodes": len(returns),
                "charts/SPS": s.steps_per_iteration / wall,
                "time/iteration": wall,
                "time/total": time.perf_counter() - run_start,
            }
            record.update({k: v for k, v in stats.items() if k.startswith(("losses/", "cpu/"))})
            # CPU seconds of this process in the iteration (in the twin, both stages share it).
            record["cpu/stage0"] = time.process_time() - cpu_start
            heads = float(stats.get("time/heads", 0.0))
            record["time/env"] = self.clock.seconds.get("env", 0.0)
            record["time/encoder"] = self.clock.seconds.get("encoder", 0.0)
            record["time/heads"] = heads
            record["time/codec"] = self.clock.seconds.get("codec", 0.0)
            # Time inside send/recv is stage1's compute plus the link; the stage1 report splits it.
            record["time/link_wait"] = max(0.0, self.clock.seconds.get("link", 0.0) - heads)
            for key, value in net_now.items():
                record[key] = value - bytes_before.get(key, 0)
                record[key.replace("net/", "net_total/", 1)] = value
            bytes_before = net_now
            records.append(record)
            self.run_log.metrics(record)
            ret = record["charts/episodic_return_ema"]
            log.info(
                "[stage0] iter %d/%d  step %d  %.0f steps/s  return(ema) %s  sent %.1f MB  recv %.1f MB",
                iteration, s.num_iterations, self.global_step, record["charts/SPS"],
                "n/a" if ret is None else f"{ret:.1f}", link.meter.total("sent") / 1e6, link.meter.total("recv") / 1e6,
            )
        return records
