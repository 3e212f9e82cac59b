"""Finding one's place: a fleet's edge among stage1's port pairs, a stage1 among the learners ``torchrun`` started."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from pathlib import Path

from ..settings import RunOptions, SettingsError, TrainSettings
from ..stages.learners import Learners
from ..transport import Transport, TransportTimeout
from ..transport.endpoints import slot_endpoint
from .links import open_link

__all__ = ["join_fleet", "join_learners"]

log = logging.getLogger(__name__)


def join_fleet(options: RunOptions, connect: str, edges: int) -> tuple[Transport, int]:
    """A fleet's edge: the link to stage1's port pair for ``--edge-id``, or without one the first pair whose
    connections stage1 admits (a taken one refuses, `splitrl.transport.gate`; the search goes round the
    edges, after a random pause, until ``--start-timeout``: edges that start together do not take turns
    refusing each other forever). Returns (the link, the edge's id)."""
    if options.edge_id >= 0:
        where = slot_endpoint(connect, options.edge_id)
        return open_link(options, where, bind=False, peer=f"stage1 at {where}"), options.edge_id
    if not options.heartbeat:
        raise SettingsError("a fleet's stage0 without --edge-id finds a free place by stage1's refusals, which need "
                            "--heartbeat > 0: give --edge-id or a heartbeat")
    deadline = time.monotonic() + options.start_timeout
    rng = random.Random()
    taken: set[int] = set()
    slot = 0
    while True:
        where = slot_endpoint(connect, slot)
        link = open_link(options, where, bind=False, peer=f"stage1 at {where}")
        try:
            if link.admitted(max(0.1, deadline - time.monotonic())):
                return link, slot
        except TransportTimeout:
            link.close()
            if not taken:
                raise
            raise TransportTimeout(f"every edge's place at stage1 at {connect} is taken (--edges {edges}; tried "
                                   f"for {options.start_timeout:g} s)") from None
        except BaseException:
            link.close()
            raise
        link.close()
        if slot not in taken:
            log.info("[stage0] edge %d of stage1 at %s is taken; trying the others", slot, connect)
            taken.add(slot)
        if time.monotonic() >= deadline:
            raise TransportTimeout(f"every edge's place at stage1 at {connect} is taken (--edges {edges}; tried for "
                                   f"{options.start_timeout:g} s)")
        slot = (slot + 1) % edges
        time.sleep(rng.uniform(0.0, 0.5))


def join_learners(settings: TrainSettings, options: RunOptions) -> tuple[Learners, RunOptions]:
    """This stage1's place among the learners ``torchrun`` started (one learner without it), and its options: a
    learner r > 0 keeps its run in RUN_DIR/learner-r (each learner checkpoints the heads it holds, the same on
    every learner, and resumes from its own directory)."""
    base = options.resume or options.run_dir
    if Learners.world_size(options.learners) > 1 and not base:  # each would choose runs/<time>-<env>, alike or not
        raise SettingsError("several learners need --run-dir RUN_DIR (or --resume RUN_DIR): learner 0 keeps its run "
                            "there, learner r > 0 in RUN_DIR/learner-r")
    # The learners meet after every rollout: one may wait for another's slowest edge, each of whose steps may
    # take --timeout. So an exchange waits at most what a rollout and a minibatch can take.
    learners = Learners.from_environment(options.start_timeout + (settings.ppo.num_steps + 2) * options.timeout,
                                         options.learners)
    if learners.alone:
        return learners, options
    options = dataclasses.replace(options, learners=learners.world)  # checked with the settings (`prepare`)
    try:
        learners.agree([settings.shared(), bool(options.resume), options.transport], "their settings")
    except BaseException:
        learners.close()
        raise
    if learners.rank:
        own = str(Path(base) / f"learner-{learners.rank}")
        options = dataclasses.replace(options, run_dir=own, resume=own if options.resume else "")
    return learners, options
