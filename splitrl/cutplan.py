"""Where to cut: every boundary of the model planned on a link from one measured run (`splitrl plan --recommend`).

Moving the cut moves layers from one machine to the other and changes what crosses the link: Neurosurgeon's
question (Kang et al., ASPLOS 2017: choose the partition point from each layer's latency on each side and the
link), asked of a training run, where what crosses is paid on every env step and again in every epoch. A
candidate cut's plan (`splitrl.plan.predict`, the run's schedule) takes, from a measured synchronous run at one
cut (`splitrl.plan.calibrate`):

- compute: what each stage spent beyond its networks in the measured run (the loop, the codecs, the framing,
  the loss: `splitrl.plan.calibrate`'s compute less the measured cut's networks timed here) carries over as it
  is, and the candidate's two halves are timed here (`splitrl.plan.Timings`), divided by ``edge_speed`` /
  ``server_speed``: each machine's speed over the measured run's, which is taken to be this one (0.25: an
  edge four times slower; the env steps on the edge too). A level per stage, as `calibrate` scales one
  cut's networks, would scale the server's whole network at the input by what its loop cost around the heads
  alone.
- bytes: each training stream's bytes per value crossing the measured cut, times the values crossing the
  candidate's (the codecs' rate per value carries over; a data-dependent codec's only roughly). At the input the
  observation crosses as it is (uint8 frames a byte a value) once a step, and training sends nothing: stage1
  trains the whole network on the observations it kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from .errors import SettingsError
from . import plan as planner
from .plan import Link, Plan, Timings, batches, calibrate, load_run, planned_workers, predict

if TYPE_CHECKING:
    from .settings import TrainSettings

__all__ = ["CutPlan", "plan_cuts"]


@dataclass(frozen=True)
class CutPlan:
    cut: str
    """The cut as it was asked for (`--cuts`), or the layer's name."""
    values: int
    """What a sample sends across the cut: the activation's values (the observation's at the input)."""
    plan: Plan
    """Its iteration on the link (`splitrl.plan.predict`)."""


def plan_cuts(settings: "TrainSettings", run_dir: str | Path, link: Link, *, vector: str, threads: int,
              only: list[str] | None = None, edge_speed: float = 1.0, server_speed: float = 1.0,
              measured_link: Link = Link(), timings: Callable[["TrainSettings"], Timings] | None = None,
              ) -> list[CutPlan]:
    """Every cut of ``settings``' model (or those in ``only``) planned on ``link``, fastest first, from the
    measured run ``run_dir`` (its codecs must be ``settings``' own, its cut any after a layer). ``timings``:
    the `Timings` of a candidate's settings (default: new ones, each timed for a few seconds here)."""
    from .models import INPUT, crossing, cuts

    if edge_speed <= 0 or server_speed <= 0:
        raise SettingsError(f"--edge-speed and --server-speed must be > 0, got {edge_speed:g} and {server_speed:g}")
    measured = load_run(run_dir)
    spec = measured.spec
    if only is not None and not only:
        raise SettingsError("--cuts names no cut: give 'all', 'none' or cuts such as input,conv2,cnn")
    kept: dict[str, Timings] = {}  # the measured cut is also a candidate: timed once
    timed = timings or (lambda s: kept.setdefault(s.cut, planner.Timings(s, spec)))
    values = ({cut: (sent, cut == INPUT) for cut, sent in cuts(settings, spec)} if only is None
              else {cut: crossing(settings, cut, spec) for cut in only})
    measured_values, observation = crossing(measured.settings, measured.settings.cut, spec)
    if observation:
        raise SettingsError(f"{run_dir}: it was cut at the input, so no activation crossed and its stage0 computed "
                            "nothing; plan cuts from a run cut after a layer")
    base = dataclasses.replace(settings, cut=measured.settings.cut)
    cal_timings = timed(measured.settings)  # the measured cut's network, as `calibrate` times it for ``base``
    rates = calibrate(run_dir, base, threads=threads, measured_link=measured_link, timings=cal_timings)
    per_group, _, minibatch = batches(settings)
    (cal_act0, cal_act1), (cal_train0, cal_train1) = (cal_timings.act(threads, per_group),
                                                      cal_timings.train(threads, minibatch))
    # What the measured run spent beyond its networks timed here, signed: the measured cut's own plan then gives
    # back its compute even where the networks time slower here than they ran (a busy moment of the timing).
    beyond = dict(act0=rates.act0 - cal_act0, act1=rates.act1 - cal_act1, train0=rates.train0 - cal_train0,
                  train1=rates.train1 - cal_train1)
    observation_bytes = float(np.prod(spec.row_shape)) * np.dtype(spec.row_dtype).itemsize
    out = []
    for cut in values:
        candidate = dataclasses.replace(settings, cut=cut)
        t = timed(candidate)
        (act0, act1), (train0, train1) = t.act(threads, per_group), t.train(threads, minibatch)
        sent, at_input = values[cut]
        scale = sent / measured_values
        stream = (dict(up_step=observation_bytes, up_sample=0.0, down_sample=0.0) if at_input else
                  dict(up_step=rates.up_step * scale, up_sample=rates.up_sample * scale,
                       down_sample=rates.down_sample * scale))
        cut_rates = dataclasses.replace(
            rates, env_step=rates.env_step / edge_speed, act0=max(0.0, beyond["act0"] + act0 / edge_speed),
            act1=max(0.0, beyond["act1"] + act1 / server_speed),
            train0=max(0.0, beyond["train0"] + train0 / edge_speed),
            train1=max(0.0, beyond["train1"] + train1 / server_speed), **stream)
        out.append(CutPlan(cut, sent, predict(candidate, cut_rates, link, vector=vector,
                                              workers=planned_workers(candidate, threads, link.cores))))
    return sorted(out, key=lambda p: p.plan.seconds)
