"""Stage1: the actor-critic heads and the PPO learner, as a reaction to stage0's messages.

`Stage1` owns no socket: `handle` takes one message and yields the replies, so
the same object serves a ZeroMQ link (`serve`) and the in-process twin.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any, Iterator

import torch
from torch import nn

from ..codecs import CodecSet, Context, HeadsSync
from ..envs import EnvSpec
from ..models import build_agent
from ..ppo import RolloutBuffer, explained_variance, minibatch_schedule, ppo_loss
from ..settings import TrainSettings
from ..transport import Message, ProtocolError, Transport
from ..transport.handshake import check_hello, send_hello
from .protocol import STAGE0, STAGE1
from ..runs import RunLog

__all__ = ["Stage1", "Stage1Server", "Reply"]

log = logging.getLogger(__name__)

Reply = tuple[str, dict[str, torch.Tensor], dict[str, Any]]


def _tensor(msg: Message, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = msg.tensors.get(name)
    if t is None:
        raise ProtocolError(f"{msg.kind}: expected tensor {name!r}, got only {sorted(msg.tensors)}")
    if tuple(t.shape) != shape or t.dtype != dtype:
        raise ProtocolError(f"{msg.kind}: tensor {name!r}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
    return t


class Stage1:
    """Heads + learner. With the cut before the first layer it also keeps the rollout's
    inputs and trains alone; otherwise every minibatch arrives as ``train_fwd``."""

    def __init__(self, settings: TrainSettings, spec: EnvSpec, run_log: RunLog | None = None) -> None:
        self.settings, self.spec, self.run_log = settings, spec, run_log
        ppo = settings.ppo
        stage0_net, self.heads = build_agent(spec.obs_shape, spec.action_dim, settings.cut, settings.seed, settings.ppo.init_log_std)
        self.optimizer = torch.optim.Adam(self.heads.parameters(), lr=ppo.lr_heads, eps=1e-5)
        self.generator = torch.Generator().manual_seed(settings.seed)
        n, t = settings.env.num_envs, ppo.num_steps
        self.buffer = RolloutBuffer(t, n, spec.action_dim)
        self.trains_alone = not any(True for _ in stage0_net.parameters())
        self.inputs = torch.zeros((t, n) + spec.obs_shape, dtype=torch.uint8) if self.trains_alone else None
        self.feature_dim = self.heads.critic[0].in_features
        self.step = 0
        self.iteration = 1
        self.schedule: list[list[torch.Tensor]] = []
        self.next_minibatch = (0, 0)
        self.stats: dict[str, list[float]] = defaultdict(list)
        self.compute_seconds = 0.0
        self._cpu_mark = time.process_time()  # process CPU seconds at the start of the iteration
        self.codecs = CodecSet(**settings.codecs.specs())
        self.all_envs = torch.arange(n)
        replica = self.codecs.replica
        self.heads_sync = HeadsSync(self.heads.replicated(), replica.sync) if replica is not None else None

    # -- helpers -------------------------------------------------------------------
    def _input(self, msg: Message, stream: str, ctx: Context, name: str = "features") -> torch.Tensor:
        """Decode stage0's features (pixels with the cut before the first layer) for ``ctx``'s rows."""
        rows = len(ctx.idx if ctx.idx is not None else ctx.envs)
        if self.trains_alone:
            shape, dtype = (rows,) + self.spec.obs_shape, torch.uint8
        else:
            shape, dtype = (rows, self.feature_dim), torch.float32
        return self.codecs.unpack(stream, name, msg.tensors, msg.header, ctx, shape, dtype)

    def _global_step(self, t: int = 0) -> int:
        """stage0's env-step count when it sent step ``t`` (or, for t = 0 after a rollout, trained)."""
        return (self.iteration - 1) * self.settings.steps_per_iteration + t * self.settings.env.num_envs

    def _record_outcome(self, step: int, msg: Message) -> None:
        n = self.settings.env.num_envs
        reward = _tensor(msg, "reward", (n,), torch.float32)
        terminated = _tensor(msg, "terminated", (n,), torch.bool)
        truncated = _tensor(msg, "truncated", (n,), torch.bool)
        final_values = torch.zeros(n)
        if "final_index" in msg.tensors:
            index = msg.tensors["final_index"]
            if index.dtype != torch.int64 or index.dim() != 1 or not bool(((index >= 0) & (index < n)).all()):
                raise ProtocolError(f"{msg.kind}: final_index: expected int64 env indices in [0, {n}), got {index}")
            ctx = Context(envs=index, global_step=self._global_step(self.step))
            final_values[index] = self.heads.get_value(self._input(msg, "rollout", ctx, "final_features"))
        self.buffer.add_outcome(step, rewards=reward, terminated=terminated, truncated=truncated, final_values=final_values)

    def _learn(self, x: torch.Tensor, idx: torch.Tensor, offset: torch.Tensor | None = None) -> None:
        """One PPO minibatch update of the heads; gradients reach ``x`` (or ``offset``, added to
        the heads' outputs) if it requires them."""
        b, ppo = self.buffer, self.settings.ppo
        _, newlogprob, entropy, newvalue = self.heads.get_action_and_value(x, b.b_actions[idx], offset=offset)
        loss, stats = ppo_loss(
            newlogprob, b.b_logprobs[idx], b.b_advantages[idx], newvalue, b.b_values[idx], b.b_returns[idx], entropy,
            clip_coef=ppo.clip_coef, vf_coef=ppo.vf_coef, ent_coef=ppo.ent_coef,
            clip_vloss=ppo.clip_vloss, norm_adv=ppo.norm_adv,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(self.heads.parameters(), ppo.max_grad_norm)
        self.optimizer.step()
        for key, value in stats.items():
            self.stats[key].append(value)

    # -- messages ------------------------------------------------------------------
    def handle(self, msg: Message) -> Iterator[Reply]:
        """React to one message from stage0, yielding replies as they are ready."""
        handler = {
            "step": self._on_step,
            "rollout_end": self._on_rollout_end,
            "train_fwd": self._on_train_fwd,
            "iter_end": self._on_iter_end,
        }.get(msg.kind)
        if handler is None:
            raise ProtocolError(f"stage1: expected one of step, rollout_end, train_fwd, iter_end, got {msg.kind!r}")
        # Time only our own work: not the sends the caller does while we are suspended.
        replies = handler(msg)
        while True:
            start = time.perf_counter()
            try:
                reply = next(replies)
            except StopIteration:
                return
            finally:
                self.compute_seconds += time.perf_counter() - start
            yield reply

    def _on_step(self, msg: Message) -> Iterator[Reply]:
        t = msg.header.get("t")
        if t != self.step or t >= self.settings.ppo.num_steps:
            raise ProtocolError(f"step: expected t={self.step}, got t={t!r}")
        n = self.settings.env.num_envs
        if t == 0:
            self.codecs.new_iteration()
        with torch.no_grad():
            if t > 0:
                self._record_outcome(t - 1, msg)
            ctx = Context(idx=t * n + self.all_envs, envs=self.all_envs, global_step=self._global_step(t))
            x = self._input(msg, "rollout", ctx)
            u, logprob, _, value = self.heads.get_action_and_value(x, generator=self.generator)
        self.buffer.add(t, actions=u, logprobs=logprob, values=value)
        if self.inputs is not None:
            self.inputs[t] = x
        self.step += 1
        yield "action", {"action": torch.tanh(u)}, {"t": t}

    def _on_rollout_end(self, msg: Message) -> Iterator[Reply]:
        ppo = self.settings.ppo
        if self.step != ppo.num_steps:
            raise ProtocolError(f"rollout_end: expected after {ppo.num_steps} steps, got it after {self.step}")
        with torch.no_grad():
            self._record_outcome(ppo.num_steps - 1, msg)
            ctx = Context(envs=self.all_envs, global_step=self._global_step(ppo.num_steps))
            last_value = self.heads.get_value(self._input(msg, "rollout", ctx))
        self.buffer.finish(last_value, ppo.gamma, ppo.gae_lambda)
        self.schedule = minibatch_schedule(
            self.settings.seed, self.iteration, ppo.epochs, self.buffer.batch_size, ppo.minibatches
        )
        self.next_minibatch = (0, 0)
        self.step = 0
        if self.heads_sync is None:
            return iter(())
        # stage0's replica of the heads, brought up to date before it trains.
        return iter([("heads", self.heads_sync.encode(self.heads.replicated()), {"iteration": self.iteration})])

    def _on_train_fwd(self, msg: Message) -> Iterator[Reply]:
        epoch, mb = msg.header.get("epoch"), msg.header.get("mb")
        if self.trains_alone or not self.schedule or (epoch, mb) != self.next_minibatch:
            raise ProtocolError(f"train_fwd: expected minibatch {self.next_minibatch}, got {(epoch, mb)}")
        idx = self.schedule[epoch][mb]
        step = self.iteration * self.settings.steps_per_iteration
        tensors: dict[str, torch.Tensor] = {}
        header: dict[str, Any] = {"epoch": epoch, "mb": mb}
        replica = self.codecs.replica
        if replica is None:
            seen = self._input(msg, "fwd", Context(idx=idx, global_step=step))
            x = seen.detach().requires_grad_()
            self._learn(x, idx)
            self.codecs.pack("bwd", "grad", x.grad, Context(idx=idx, mask=seen != 0, global_step=step), tensors, header)
        else:
            # The heads train on the rollout's features plus the change stage0's replica saw.
            ctx = Context(idx=idx, global_step=step)
            width = self.spec.action_dim + 1
            change = self.codecs.unpack("fwd", "outputs", msg.tensors, msg.header, ctx, (len(idx), width), torch.float32)
            offset = change.requires_grad_()
            self._learn(replica.view_rows(idx, self.feature_dim), idx, offset)
            self.codecs.pack("bwd", "grad", offset.grad, ctx, tensors, header)
        ppo = self.settings.ppo
        due = [] if replica is None else replica.due(epoch, mb, ppo.epochs, ppo.minibatches, self.heads_sync.view)
        mb += 1
        self.next_minibatch = (epoch + 1, 0) if mb == ppo.minibatches else (epoch, mb)
        yield "train_bwd", tensors, header
        if due:  # the replica's weights, brought closer to the heads' mid-iteration
            parts = self.heads_sync.encode(self.heads.replicated(), due)
            yield "heads", parts, {"iteration": self.iteration, "epoch": header["epoch"], "mb": header["mb"]}

    def _on_iter_end(self, msg: Message) -> Iterator[Reply]:
        iteration = msg.header.get("iteration")
        if iteration != self.iteration:
            raise ProtocolError(f"iter_end: expected iteration {self.iteration}, got {iteration!r}")
        if self.trains_alone:
            flat = self.inputs.reshape((-1,) + self.spec.obs_shape)
            for epoch, minibatches in enumerate(self.schedule):
                for idx in minibatches:
                    self._learn(flat[idx], idx)
                yield "progress", {}, {"epoch": epoch}
        elif self.next_minibatch != (self.settings.ppo.epochs, 0):
            raise ProtocolError(f"iter_end: expected after all minibatches, got it before minibatch {self.next_minibatch}")
        stats: dict[str, Any] = {k: sum(v) / len(v) for k, v in self.stats.items() if v}
        stats["losses/explained_variance"] = explained_variance(self.buffer.b_values, self.buffer.b_returns)
        stats["time/heads"] = self.compute_seconds
        if msg.header.get("checkpoint") and self.run_log is not None:
            self.run_log.checkpoint(STAGE1, iteration, self.state_dict())
        cpu_now = time.process_time()  # after the checkpoint, as stage0's figure includes its own
        stats["cpu/stage1"] = cpu_now - self._cpu_mark
        self._cpu_mark = cpu_now
        self.stats.clear()
        self.compute_seconds = 0.0
        self.schedule = []
        self.iteration += 1
        yield "iter_stats", {}, stats

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "heads": self.heads.state_dict(), "optimizer": self.optimizer.state_dict()}


class Stage1Server:
    """Feeds one stage0 session's messages to a `Stage1` and sends its replies.

    The first message must be stage0's ``hello``; ``close`` ends the session.
    """

    def __init__(self, stage1: Stage1, transport: Transport) -> None:
        self.stage1, self.transport = stage1, transport
        self.connected = False
        self.closed = False

    def process(self, msg: Message) -> None:
        shared = self.stage1.settings.shared()
        if not self.connected:
            # Answer before checking, so a mismatch is reported on both sides.
            send_hello(self.transport, STAGE1, shared)
            check_hello(msg, STAGE1, STAGE0, shared, self.transport.peer)
            self.connected = True
            log.info("[stage1] stage0 connected")
        elif msg.kind == "close":
            self.closed = True
        else:
            for kind, tensors, header in self.stage1.handle(msg):
                self.transport.send(kind, tensors, header)

    def serve_one(self, timeout: float | None = None) -> None:
        self.process(self.transport.recv(timeout=timeout))

    def serve(self, *, start_timeout: float, timeout: float) -> int:
        """Serve until stage0 says ``close``; returns the iterations served.

        Any error is sent to the peer as ``abort`` before it propagates, so
        stage0 stops too instead of waiting out its timeout.
        """
        try:
            self.serve_one(start_timeout)
            while not self.closed:
                self.serve_one(timeout)
        except BaseException as exc:
            self.transport.abort(f"stage1 failed: {type(exc).__name__}: {exc}")
            raise
        log.info("[stage1] stage0 closed the session after %d iterations", self.stage1.iteration - 1)
        return self.stage1.iteration - 1
