"""The planner: seconds per iteration, bytes per env step, each machine's busy fraction and the staleness of a
configuration on a link, predicted from measured rates; and a recommendation for a link.

The rates come from a measured run on the machines in question (`calibrate`): a run's metrics give
the env step time, each stage's compute over an iteration and the bytes of every stream. How a
stage's compute divides between the rollout (one small batch per env step) and training (a
minibatch's forward and backward, every epoch), and how it changes with the batch and the torch
threads, comes from timing the same networks for a moment on this machine (`Timings`); the
run's totals then set the level, so a busy machine's slower run calibrates a slower plan.

The schedules (`predict`), per iteration of E envs x T steps, K epochs of B minibatches of b samples:

- sync: every env step pays the envs, both stages' acting compute, a round trip and its bytes;
  every minibatch pays both stages' compute, a round trip and its bytes. Nothing overlaps.
- pipelined, G groups: a vector step takes the longest of one group's whole cycle (its envs, both
  stages, the round trip) and each resource's share of the step (stage0, stage1, the link's bytes,
  the cores the processes share). M micro-batches: a minibatch is a three-stage pipeline (stage0,
  the link's bytes, stage1) of M items plus one round trip (the optimizer step is a barrier), each
  stage taking up to W of its items at once (its ``--part-workers``).
- async: the rollout of i + 1 beside the training of i: the longer of the two, or all the CPU
  work over the cores where the processes share them. Every sample is one version old, or with
  --publish epoch (the rollout paced against training's epochs) (E + 1) / (2E) of an iteration on average.

A "layout invariant" (Sample Factory, PipelineRL): the asynchronous schedule is balanced when the
rollout produces samples as fast as training consumes them; `Plan.balance` is rollout time over
training time (1.0 balanced; below, the rollout waits on the learner and staleness is at its cap).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .errors import SettingsError
from .netem.shaping import tbf_sizes
from .netem.tc import FRAME_BYTES, MSS_BYTES
from .runs import iteration_bytes, measured_records, read_metrics, run_config

if TYPE_CHECKING:
    from .envs import EnvSpec
    from .settings import TrainSettings

__all__ = ["Timings", "Rates", "Link", "Plan", "RunConfig", "load_run", "calibrate", "overheads", "predict", "layouts",
           "recommend", "TCP_GOODPUT", "batches", "levels", "typical", "trains_alone"]

TCP_GOODPUT = MSS_BYTES / FRAME_BYTES
"""Application bytes per byte tc counts on a full-size segment (Ethernet 14 + IPv4 20 + TCP 20 + timestamps 12 of
headers): the ceiling `splitrl bench lab` finds on a shaped link (docs/benchmarks/lab.md)."""


@dataclass(frozen=True)
class Rates:
    """What a configuration costs on these machines, seconds of wall time of the stage alone."""

    env_step: float
    """One env's step (the simulator, the frame stack), in stage0's process."""
    act0: float
    act1: float
    """One rollout step's compute on stage0 (encoder, codec) / stage1 (heads, sampling) for one group's envs."""
    train0: float
    train1: float
    """One minibatch's compute on stage0 / stage1 at the configuration's threads."""
    up_step: float
    down_step: float
    """Bytes on the link per env step during the rollout, stage0 -> stage1 / back."""
    up_sample: float
    down_sample: float
    """Bytes per training sample per epoch, each way."""
    other: float
    """Bytes per iteration outside those (the rollout's end, the replica's updates, the iteration's stats)."""
    per_byte: float = 0.0
    """Seconds per byte the transport itself costs beyond the link's rate (loopback's copies and framing),
    from the calibration run's wait on the link."""
    per_message: float = 0.0
    """Seconds per round trip the stages cost beyond the link's round trip (each message's wake-ups, framing
    and handling), from the calibration run's wait on the link (`overheads`)."""


@dataclass(frozen=True)
class Link:
    """The link between the stages: ``rate`` bits/s as tc sets it (0: unshaped) and the round trip in s."""

    rate: float = 0.0
    rtt: float = 0.0
    cores: int = 2
    """Cores of each machine."""
    shared: bool = True
    """Both stages (and the env workers) on the same machine's cores, as in every bench on one host."""
    burst: float = 0.0
    """Bytes (as tc counts them) the shaper lets through at once after an idle spell: tbf's bucket, which fills
    at the rate while the link is idle (`shaped`); 0: a link that never sends above its rate."""

    @classmethod
    def shaped(cls, rate: float, rtt: float = 0.0, **kwargs: Any) -> "Link":
        """The link `splitrl netem` and the lab make: ``rate`` bits/s through tbf with its bucket
        (`splitrl.netem.shaping.tbf_sizes`)."""
        return cls(rate=rate, rtt=rtt, burst=float(tbf_sizes(int(rate))[0]) if rate else 0.0, **kwargs)

    def transfer(self, nbytes: float, per_byte: float = 0.0, idle: float = 0.0) -> float:
        """Seconds ``nbytes`` of ours take beyond what the link did for them while idle ``idle`` seconds before
        (the bucket's tokens: a message that fits them leaves at once)."""
        rate = self.rate * TCP_GOODPUT / 8 if self.rate else math.inf
        saved = min(self.burst * TCP_GOODPUT, idle * rate)
        return max(0.0, nbytes - saved) / rate + nbytes * per_byte


@dataclass(frozen=True)
class Plan:
    seconds: float
    """Per iteration."""
    rollout: float
    training: float
    bytes_per_step: float
    busy0: float
    busy1: float
    """CPU seconds of each stage over the iteration's wall seconds (the env workers not in stage0's)."""
    staleness: float
    balance: float
    """Rollout time over training time (the asynchronous schedule is balanced at 1.0)."""

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def batches(settings: "TrainSettings") -> tuple[int, int, int]:
    """(envs per group, groups, minibatch samples)."""
    envs = settings.env.num_envs
    groups = settings.schedule.groups(envs) or envs
    return envs // groups, groups, envs * settings.ppo.num_steps // settings.ppo.minibatches


class Timings:
    """The configuration's networks timed on this machine, on random observations, each call the median
    of about ``seconds`` of calls after a warm-up (robust to a moment's contention, not to a machine kept
    busy: time on an idle machine). Timed once per (threads, batch) and kept.

    `act` is one rollout step for ``batch`` envs: stage0's encoder forward, stage1's heads sampling an
    action. `train` is one minibatch's forward, backward and Adam step on each stage. ``threads``: torch
    intra-op threads (0: torch's default)."""

    def __init__(self, settings: "TrainSettings", spec: "EnvSpec", seconds: float = 2.0) -> None:
        self.settings, self.spec, self.seconds = settings, spec, seconds
        self._cache: dict[tuple[str, int, int], tuple[float, float]] = {}

    def act(self, threads: int, batch: int) -> tuple[float, float]:
        return self._timed("act", threads, batch)

    def train(self, threads: int, minibatch: int) -> tuple[float, float]:
        return self._timed("train", threads, minibatch)

    def _timed(self, what: str, threads: int, batch: int) -> tuple[float, float]:
        import torch

        key = (what, threads or torch.get_num_threads(), batch)
        if key not in self._cache:
            before = torch.get_num_threads()
            torch.set_num_threads(key[1])
            try:
                self._cache[key] = self._measure(what, batch)
            finally:
                torch.set_num_threads(before)
        return self._cache[key]

    def _measure(self, what: str, batch: int) -> tuple[float, float]:
        import torch

        from .models import agent
        from .ppo import adam

        encoder, heads = agent(self.settings, self.spec)
        gen = torch.Generator().manual_seed(0)
        shape = (batch, *self.spec.row_shape)
        x = (torch.randn(shape, generator=gen) if self.spec.row_dtype == "float32"
             else torch.randint(0, 255, shape, dtype=torch.uint8, generator=gen))
        with torch.no_grad():
            feats = encoder(x)
        alone = not len(encoder)  # cut at the input: stage0 computes nothing, stage1 takes the observations
        if what == "act":
            with torch.no_grad():
                return (0.0 if alone else self._median(lambda: encoder(x)),
                        self._median(lambda: heads.get_action_and_value(feats)))
        fused = self.settings.ppo.fused_adam
        opt0 = adam(encoder.parameters(), 1e-5, fused=fused) if not alone else None
        opt1 = adam(heads.parameters(), 1e-5, fused=fused)

        def step0() -> None:
            out = encoder(x)
            opt0.zero_grad()
            out.backward(torch.ones_like(out) / out.numel())
            opt0.step()

        def step1() -> None:
            f = feats if alone else feats.clone().requires_grad_(True)
            _, logp, ent, value = heads.get_action_and_value(f)
            opt1.zero_grad()
            (value.square().mean() - logp.mean() - ent.mean()).backward()
            opt1.step()

        return 0.0 if alone else self._median(step0), self._median(step1)

    def _median(self, call) -> float:
        call()
        times: list[float] = []
        while sum(times) < self.seconds or len(times) < 5:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]


def _network(settings: "TrainSettings", observation: str) -> tuple[Any, ...]:
    """What sets the network's compute and (the first six) its bytes besides the codecs: the model (``auto``
    resolved for the run's ``observation`` kind) and its kwargs, the cut, the bottleneck; then the env and the
    heads' width."""
    settings = settings.for_observation(observation)
    autoencoder = settings.bottleneck_train == "autoencoder"
    return (settings.model, settings.model_kwargs, settings.cut, settings.bottleneck, settings.bottleneck_train,
            settings.autoencoder_every if autoencoder else None, settings.env.env_id, settings.hidden)


def _per_kind(records: Sequence[dict[str, Any]], kind: str, direction: str) -> float:
    return sum(r.get(f"net/{kind}/{direction}_bytes", 0) for r in records) / len(records)


def calibrate(run_dir: str | Path, target: "TrainSettings", *, threads: int, bytes_from: str | Path | None = None,
              measured_link: Link = Link(), timings: Timings | None = None) -> Rates:
    """The rates of ``target`` (at ``threads`` intra-op threads, 0: the default) on the machines ``run_dir``
    was measured on.

    ``run_dir``: a measured run, best a synchronous one (its phases are timed one at a time): its env step
    time, and its stages' compute, which sets the level of the networks' `Timings` here.
    ``bytes_from``: a run with the target's codecs and cut, for the bytes of each stream per sample
    (default: ``run_dir``, which must then have them). ``measured_link``: the link ``run_dir`` ran on (what
    its wait on the link beyond that link's round trips and rate is the stages' own cost of a message: a cost a
    round trip and a cost a byte where the run timed its rollout's wait apart, `overheads`; else all of it a cost
    a byte).
    ``timings``: the networks' `Timings` on this machine, reused across calls (default: new ones).
    """
    run = Path(run_dir)
    measured = load_run(run)
    cal = measured.settings
    used = typical(measured_records(read_metrics(run), skip_last=True))
    mean = lambda key: sum(float(r.get(key, 0.0)) for r in used) / len(used)  # noqa: E731
    if cal.schedule.mode != "sync":
        raise SettingsError(f"{run}: calibrate from a synchronous run (its phases are timed one at a time); "
                            f"this one is {cal.schedule.mode}")
    kind = measured.spec.observation
    if _network(target, kind) != _network(cal, kind):
        raise SettingsError(f"{run}: the calibration run must have the target's network (--model, --model-kwargs, "
                            f"--cut, --bottleneck, --bottleneck-train, env, --hidden)")
    timings = timings or Timings(target, measured.spec)
    level0, level1 = levels(measured, used, timings)
    tgt_g, _, tgt_mb = batches(target)
    (act0, act1), (train0, train1) = timings.act(threads, tgt_g), timings.train(threads, tgt_mb)
    steps = cal.ppo.num_steps
    env_step = mean("time/env") / steps / (cal.env.num_envs if measured.vector == "sync" else 1)

    source = used if bytes_from is None else measured_records(read_metrics(bytes_from), skip_last=True)
    source_settings = cal if bytes_from is None else load_run(bytes_from).settings
    if target.codecs.link_budget:
        raise SettingsError("--link-budget: its codecs change every iteration; plan the settings it chooses "
                            "(metrics.jsonl budget/spec/*) instead")
    if source_settings.codecs != target.codecs or _network(source_settings, kind)[:6] != _network(target, kind)[:6]:
        raise SettingsError(f"{bytes_from or run}: its codecs or what crosses the cut (--model, --model-kwargs, "
                            f"--cut, --bottleneck) differ from the target's; pass "
                            f"--bytes-from RUN_DIR of a measured run with the target's codecs")
    s_steps = source_settings.ppo.num_steps * source_settings.env.num_envs
    s_samples = s_steps * source_settings.ppo.epochs
    up_step, down_step = _per_kind(source, "step", "sent") / s_steps, _per_kind(source, "action", "recv") / s_steps
    up_sample = _per_kind(source, "train_fwd", "sent") / s_samples
    down_sample = _per_kind(source, "train_bwd", "recv") / s_samples
    total = sum(iteration_bytes(r) for r in source) / len(source)
    other = total - s_steps * (up_step + down_step) - s_samples * (up_sample + down_sample)
    cal_bytes = sum(iteration_bytes(r) for r in used) / len(used)
    trained = _per_kind(used, "train_fwd", "sent") > 0  # (cut at the input: stage1 trained alone)
    trips_t = cal.ppo.epochs * (cal.ppo.minibatches if trained else 1)
    # The whole wait, every byte charged at the rate (the bucket left out: a shaped calibration link's own cost
    # per byte comes out low, or none).
    beyond = mean("time/link_wait") - (steps + trips_t) * measured_link.rtt - measured_link.transfer(cal_bytes)
    per_byte, per_message = (max(0.0, beyond) / cal_bytes if cal_bytes else 0.0), 0.0
    if all("time/link_wait_rollout" in r for r in used) and trained:
        # The rollout's wait (many small messages) apart from training's (few large ones): two equations. A step's
        # message each way takes from the bucket the env's step between two messages filled.
        up_r, down_r = _per_kind(used, "step", "sent"), _per_kind(used, "action", "recv")
        bytes_r, idle = up_r + down_r, mean("time/env") / steps
        wait_r = mean("time/link_wait_rollout")
        beyond_r = wait_r - steps * (measured_link.rtt + measured_link.transfer(up_r / steps, idle=idle)
                                     + measured_link.transfer(down_r / steps, idle=idle))
        beyond_t = (mean("time/link_wait") - wait_r - trips_t * measured_link.rtt
                    - measured_link.transfer(cal_bytes - bytes_r))
        per_message, per_byte = overheads(beyond_r, steps, bytes_r, beyond_t, trips_t, cal_bytes - bytes_r)
    return Rates(env_step=env_step,
                 act0=level0 * act0, act1=level1 * act1, train0=level0 * train0, train1=level1 * train1,
                 up_step=up_step, down_step=down_step, up_sample=up_sample, down_sample=down_sample,
                 other=max(0.0, other), per_byte=per_byte, per_message=per_message)


def overheads(beyond_r: float, trips_r: float, bytes_r: float, beyond_t: float, trips_t: float,
              bytes_t: float) -> tuple[float, float]:
    """(seconds a round trip, seconds a byte) that explain the waits beyond the link, ``beyond_r`` over the
    rollout's ``trips_r`` round trips of ``bytes_r`` bytes and ``beyond_t`` over training's: two equations in
    two unknowns, neither negative (where the exact answer has one below 0, the other alone explains both)."""
    det = trips_r * bytes_t - trips_t * bytes_r
    if det:
        per_message = (beyond_r * bytes_t - beyond_t * bytes_r) / det
        per_byte = (trips_r * beyond_t - trips_t * beyond_r) / det
        if per_message >= 0.0 and per_byte >= 0.0:
            return per_message, per_byte
    total, trips, nbytes = beyond_r + beyond_t, trips_r + trips_t, bytes_r + bytes_t
    by_message = max(0.0, total) / trips if trips else 0.0
    by_byte = max(0.0, total) / nbytes if nbytes else 0.0
    # the one of the two that leaves the smaller error on the phases' waits
    err_m = abs(beyond_r - by_message * trips_r) + abs(beyond_t - by_message * trips_t)
    err_b = abs(beyond_r - by_byte * bytes_r) + abs(beyond_t - by_byte * bytes_t)
    return (by_message, 0.0) if err_m <= err_b else (0.0, by_byte)


def typical(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measured iteration of median length (the shorter of two), whole: one iteration that a busy moment
    of the machine slowed moves a mean, not this."""
    ordered = sorted(records, key=lambda r: float(r.get("time/iteration", 0.0)))
    return [ordered[(len(ordered) - 1) // 2]] if ordered else []


def levels(measured: "RunConfig", used: Sequence[dict[str, Any]], timings: Timings) -> tuple[float, float]:
    """Each stage's compute in the measured run (its records ``used``) over what its networks alone take here
    (``timings``, of the run's network): the level of the run's machine, its load, and the codecs and the loss
    around the networks. 1.0 for a stage with nothing to time (stage0 cut at the input)."""
    cal = measured.settings
    cal_g, _, cal_mb = batches(cal)
    (act0, act1), (train0, train1) = timings.act(measured.threads, cal_g), timings.train(measured.threads, cal_mb)
    steps, updates = cal.ppo.num_steps, cal.ppo.epochs * cal.ppo.minibatches
    out = []
    for key, act, train in (("time/encoder", act0, train0), ("time/heads", act1, train1)):
        alone = steps * act + updates * train
        out.append(sum(float(r.get(key, 0.0)) for r in used) / len(used) / alone if alone else 1.0)
    return out[0], out[1]


@dataclass(frozen=True)
class RunConfig:
    """What a run directory says about how it ran: stage0's settings, the env, its options, torch's threads."""

    settings: "TrainSettings"
    spec: "EnvSpec"
    threads: int
    """Intra-op threads as run (the default resolved)."""
    vector: str
    """'sync' or 'async' as run."""
    part_workers: int = 1
    """``--part-workers`` as run (0: its default; a run from before the option took its micro-batches in turn)."""


def load_run(run_dir: str | Path) -> RunConfig:
    from .envs import EnvSpec, choose_vector
    from .settings import TrainSettings

    config = run_config(run_dir)
    settings = TrainSettings.from_dict(config["settings"])
    spec = EnvSpec.from_config(config["env_spec"])
    options = config.get("options", {})
    # A config without "vector" (codec-learning's and learning-check*'s under docs/results) stepped its envs in process.
    return RunConfig(settings, spec, int(config.get("torch_threads") or options.get("threads") or 0),
                     choose_vector(options.get("vector", "sync"), settings.env.num_envs),
                     int(options.get("part_workers", 1)))


def predict(settings: "TrainSettings", rates: Rates, link: Link, *, vector: str = "sync", workers: int = 1) -> Plan:
    """Seconds per iteration (and the rest of `Plan`) of ``settings`` at ``rates`` on ``link``; ``vector``:
    'sync' (the envs in stage0's process) or 'async' (one worker process each); ``workers``: the micro-batches
    each stage takes at once (`planned_workers`)."""
    envs, steps = settings.env.num_envs, settings.ppo.num_steps
    per_group, groups, minibatch = batches(settings)
    updates = settings.ppo.epochs * settings.ppo.minibatches
    micro = settings.schedule.microbatches
    cores = link.cores

    def xfer(nbytes: float, idle: float = 0.0) -> float:
        return link.transfer(nbytes, rates.per_byte, idle)

    # The rollout, per vector step (every env once). Each way the link idles while the rest of the cycle runs:
    # a shaper's bucket fills meanwhile, and a step's message that fits it leaves at once.
    in_process = vector == "sync"
    env_group = rates.env_step * (per_group if in_process else max(1.0, per_group / cores))
    rtt = link.rtt + rates.per_message  # a round trip: the link's, and what the stages spend on it
    rest = env_group + rates.act0 + rates.act1 + rtt
    up = xfer(per_group * rates.up_step, rest + xfer(per_group * rates.down_step, rest))
    down = xfer(per_group * rates.down_step, rest + up)
    cycle = rest + up + down
    stage0_share = groups * (rates.act0 + (rates.env_step * per_group if in_process else 0.0))
    stage1_share = groups * rates.act1
    env_cpu = envs * rates.env_step
    cpu_share = (env_cpu + groups * (rates.act0 + rates.act1)) / cores if link.shared else 0.0
    if not link.shared and not in_process:
        cpu_share = (env_cpu + groups * rates.act0) / cores
    # The link's share: G groups' messages back to back leave it no idle spell to fill a bucket in.
    link_share = groups * max(xfer(per_group * rates.up_step), xfer(per_group * rates.down_step))
    vector_step = max(cycle, stage0_share, stage1_share, link_share, cpu_share)
    if groups == 1:
        vector_step = cycle
    rollout = steps * vector_step

    # Training, per minibatch; where nothing crosses in training (the cut at the input: stage1 trains alone), no
    # round trip a minibatch either, and one message an epoch.
    if trains_alone(rates):
        training = updates * (rates.train0 + rates.train1) + settings.ppo.epochs * rtt / 2
    else:
        update = minibatch_seconds(rates.train0, rates.train1, xfer(minibatch * rates.up_sample),
                                   xfer(minibatch * rates.down_sample), rtt, micro, workers)
        if link.shared:
            update = max(update, (rates.train0 + rates.train1) / cores)
        training = updates * update

    other = xfer(rates.other)
    cpu0 = steps * groups * rates.act0 + updates * rates.train0 + (env_cpu * steps if in_process else 0.0)
    cpu1 = steps * groups * rates.act1 + updates * rates.train1
    if settings.schedule.asynchronous and settings.schedule.max_staleness >= 1:
        work = cpu0 + cpu1 + (0.0 if in_process else env_cpu * steps)
        seconds = max(rollout, training, work / cores if link.shared else 0.0) + other
        per_iteration = settings.versions_per_iteration  # the lag runs from P versions down to 1: P of them
        staleness = (per_iteration + 1) / (2 * per_iteration)
    else:
        seconds = rollout + training + other
        staleness = 0.0
    samples = envs * steps
    nbytes = samples * (rates.up_step + rates.down_step) + samples * settings.ppo.epochs * (
        rates.up_sample + rates.down_sample) + rates.other
    return Plan(seconds=seconds, rollout=rollout, training=training, bytes_per_step=nbytes / samples,
                busy0=cpu0 / seconds, busy1=cpu1 / seconds, staleness=staleness,
                balance=rollout / training if training else math.inf)


def planned_workers(settings: "TrainSettings", threads: int, cores: int, configured: int = 0) -> int:
    """The micro-batches a stage of ``settings`` takes at once on ``cores`` cores at ``threads`` intra-op threads
    (``--part-workers``, ``configured``; 0 its default): 1 where its networks take them in turn
    (`splitrl.schedule.workers.concurrent_safe`)."""
    from .schedule.workers import worker_count

    if settings.schedule.microbatches == 1 or not _concurrent_safe(dataclasses.replace(settings, schedule=type(
            settings.schedule)())):
        return 1
    return worker_count(threads, configured, cores)


@functools.lru_cache(maxsize=8)
def _concurrent_safe(settings: "TrainSettings") -> bool:
    """Whether both halves of ``settings``' network may take micro-batches at once (the schedule left out: the
    same network for every layout)."""
    from .envs import inspect_env
    from .models import agent
    from .schedule.workers import concurrent_safe

    spec = inspect_env(settings.env)
    return all(concurrent_safe(net) for net in agent(settings.for_observation(spec.observation), spec))


def trains_alone(rates: Rates) -> bool:
    """Nothing crosses the link in training: the cut is at the input and stage1 trains the whole network."""
    return rates.up_sample == rates.down_sample == 0.0


FORWARD_SHARE = 1 / 3
"""Stage0's forward in its minibatch compute (forward, backward, step): a backward costs about two forwards."""


def minibatch_seconds(train0: float, train1: float, up: float, down: float, rtt: float, micro: int,
                      workers: int = 1) -> float:
    """One training minibatch in ``micro`` micro-batches as `splitrl.schedule.training` runs it: stage0
    forwards every micro-batch and sends each as it is done, stage1 takes each as it arrives, and stage0
    back-propagates each gradient as it arrives; the link is full duplex (``up``, ``down``: the whole
    minibatch's transfer each way) and each message also pays half the round trip. Each stage takes up to
    ``workers`` micro-batches at once (`splitrl.schedule.workers`), each part as soon as it is ready and a
    worker is free; with one, its parts go in turn (stage0's backwards after all its forwards)."""
    forward, backward = train0 * FORWARD_SHARE / micro, train0 * (1 - FORWARD_SHARE) / micro
    free0, free1 = [0.0] * max(1, workers), [0.0] * max(1, workers)

    def take(free: list[float], ready: float, seconds: float) -> float:
        i = min(range(len(free)), key=free.__getitem__)
        free[i] = max(free[i], ready) + seconds
        return free[i]

    forwarded = [take(free0, 0.0, forward) for _ in range(micro)]
    sent = back = arrived = 0.0
    for j in range(micro):
        sent = max(forwarded[j], sent) + up / micro
        back = max(take(free1, sent + rtt / 2, train1 / micro), back) + down / micro  # replies go in order
        arrived = max(arrived, take(free0, back + rtt / 2, backward))
    return arrived


def layouts(settings: "TrainSettings", *, allow_stale: bool = False) -> list[tuple[str, "TrainSettings", int]]:
    """Candidate schedules for ``settings``' envs and samples: (name, settings, threads). The synchronous
    one at torch's default threads; the overlapping ones at one thread a stage (two processes computing at
    once), every divisor of the envs as groups, micro-batches 1, 2, 4 dividing the minibatch; ``allow_stale``:
    the asynchronous schedule too (its samples are one version old: learning changes, docs/benchmarks/pipeline.md)."""
    envs = settings.env.num_envs
    _, _, minibatch = batches(settings)
    sched = settings.schedule
    out = [("sync", dataclasses.replace(settings, schedule=dataclasses.replace(
        sched, rollout_groups="1", microbatches=1, asynchronous=False, publish="iteration")), 0)]
    for groups in [g for g in range(1, envs + 1) if envs % g == 0]:
        for micro in [m for m in (1, 2, 4) if minibatch % m == 0]:
            if groups == 1 and micro == 1:
                continue
            for asynchronous in ((False, True) if allow_stale else (False,)):
                publish = sched.publish if asynchronous else "iteration"  # (--publish epoch is async's alone)
                name = (f"{'async' if asynchronous else 'pipelined'} groups={groups} micro-batches={micro}"
                        + (" publish=epoch" if publish == "epoch" else ""))
                out.append((name, dataclasses.replace(settings, schedule=dataclasses.replace(
                    sched, rollout_groups=str(groups), microbatches=micro, asynchronous=asynchronous,
                    publish=publish)), 1))
    return out


def recommend(settings: "TrainSettings", run_dir: str | Path, link: Link, *, vector: str,
              bytes_from: str | Path | None = None, allow_stale: bool = False, measured_link: Link = Link(),
              timings: Timings | None = None, part_workers: int = 0) -> list[tuple[str, "TrainSettings", Plan]]:
    """Every `layouts` candidate's plan on ``link``, fastest first (``part_workers``: ``--part-workers``)."""
    plans = []
    for name, candidate, threads in layouts(settings, allow_stale=allow_stale):
        rates = calibrate(run_dir, candidate, threads=threads, bytes_from=bytes_from, measured_link=measured_link,
                          timings=timings)
        plans.append((name, candidate, predict(candidate, rates, link, vector=vector,
                                               workers=planned_workers(candidate, threads, link.cores,
                                                                       part_workers))))
    return sorted(plans, key=lambda p: (round(p[2].seconds, 6), p[2].staleness))
