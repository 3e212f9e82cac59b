"""Stage1 as a process: bind the link (a fleet's: a port pair per edge), answer the hellos, resume, serve the
schedule's loop until stage0 closes; with ``--rejoin``, wait for a lost stage0 to come back.

Any error is sent to stage0 (every edge) as ``abort`` before it propagates, so the peer stops too instead
of waiting out its timeout.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..envs import EnvSpec
from ..runs import RunLog, intact_checkpoints, load_checkpoint
from ..schedule import fleet
from ..schedule.roster import Roster
from ..settings import RunOptions, TrainSettings
from ..stages import STAGE0, STAGE1, Learner, learner_exchange
from ..stages.learners import Learners, edge_range
from ..transport import PeerGone, Transport
from ..transport.endpoints import slot_endpoint
from ..transport.handshake import HandshakeError, answer_hello
from . import build
from .joining import join_learners
from .links import check_exposure, open_link
from .rundir import prepare, resume_point

__all__ = ["serve_stage1", "serve_fleet", "run_stage1"]

log = logging.getLogger(__name__)


def serve_stage1(learner: Learner, link: Transport, run_log: RunLog | None = None, *,
                 start_timeout: float | None = None, resume: bool = False) -> int:
    """Answer stage0's hello, serve every iteration until stage0 closes; returns the iterations served."""
    shared = learner.settings.shared()
    try:
        exchange = learner_exchange(learner)
        ours = intact_checkpoints(run_log.dir, STAGE1) if resume and run_log is not None else []
        # Answers before checking, so a mismatch is reported on both sides.
        hello = answer_hello(link, STAGE1, STAGE0, shared, timeout=start_timeout,
                             extra={"checkpoints": ours} if resume else None)
        log.info("[stage1] stage0 connected")
        resumed = None
        if resume:
            iteration = resume_point(hello, ours)
            if iteration:
                resumed = load_checkpoint(run_log.dir, STAGE1, iteration)
                learner.load_state_dict(resumed)
                exchange.load_state_dict(resumed["exchange"])
            log.info("[stage1] resuming after iteration %d", iteration)
        schedule = build.SCHEDULES[learner.settings.schedule.mode]
        schedule.stage1_open(learner, link)
        if resumed is not None and "link" in resumed:  # numbering on from the checkpoint, as stage0 does
            link.go_on_from(resumed["link"])
        served = schedule.stage1_loop(learner, exchange, link, run_log)
    except PeerGone:
        raise  # nobody to tell; an abort left queued could meet a rejoining stage0 first
    except BaseException as exc:
        link.abort(f"stage1 failed: {type(exc).__name__}: {exc}")
        raise
    log.info("[stage1] stage0 closed the session after iteration %d", served)
    return served


def serve_fleet(learner: Learner, links: list[Transport], settings: TrainSettings, run_log: RunLog | None = None, *,
                start_timeout: float | None = None, min_edges: int = 0, rejoin: float = 0.0,
                act_wait: float | None = None, resume: bool = False, first: int = 0) -> int:
    """Stage1 of a fleet: the edges' hellos (edge first + g on ``links[g]``; all of them, or ``min_edges``), then
    `fleet.stage1_loop` until they close (`Roster`: edges that fail are dropped, edges that come join).
    ``resume``: from the newest iteration stage1 and every edge that came have a checkpoint of
    (`Roster.resume`). Of several learners (``learner.learners``), this one serves the edges from ``first``."""
    try:
        exchange = learner_exchange(learner)
        roster = Roster(links, settings.shared(), min_edges, rejoin, first=first,
                        total=settings.schedule.edges, learners=learner.learners)
        ours = intact_checkpoints(run_log.dir, STAGE1) if resume and run_log is not None else []
        if resume:
            roster.answer_extra = {"checkpoints": ours}
        roster.start(start_timeout if start_timeout is not None else RunOptions().start_timeout)
        if resume:
            state: dict[str, Any] = {}

            def load(point: int) -> dict[str, Any]:
                assert run_log is not None  # stage1 holds checkpoints of ``point``
                state.update(load_checkpoint(run_log.dir, STAGE1, point))
                return state

            iteration = roster.resume(ours, load)
            if iteration:
                learner.load_state_dict(state)
                exchange.load_state_dict(state["exchange"])
            log.info("[stage1] resuming the fleet after iteration %d", iteration)
        served = fleet.stage1_loop(learner, exchange, roster, run_log, act_wait)
    except BaseException as exc:
        for link in links:
            link.abort(f"stage1 failed: {type(exc).__name__}: {exc}")
        raise
    log.info("[stage1] the fleet's edges closed the session after iteration %d", served)
    return served


def _run_fleet_stage1(settings: TrainSettings, options: RunOptions, bind: str, spec: EnvSpec, run_log: RunLog,
                      learners: Learners) -> int:
    learner = build.make_learner(settings, spec, options)
    learner.learners = learners
    ids = edge_range(settings.schedule.edges, learners.world, learners.rank)
    links: list[Transport] = []
    try:
        for k in ids:
            links.append(open_link(options, slot_endpoint(bind, k), bind=True, peer=f"edge {k}"))
        log.info("[stage1] listening for %s on %s (edge k: port + 2k)", f"{len(links)} edges" if learners.alone else
                 f"edges {ids.start} .. {ids.stop - 1} of {settings.schedule.edges}", links[0].endpoint)
        return serve_fleet(learner, links, settings, run_log, start_timeout=options.start_timeout,
                           min_edges=options.min_edges if learners.alone else 0,  # 0: all of this one's edges
                           rejoin=options.rejoin,
                           act_wait=options.act_wait_seconds(), resume=bool(options.resume), first=ids.start)
    finally:
        for link in links:
            link.close()


def run_stage1(settings: TrainSettings, options: RunOptions, bind: str) -> int:
    """``splitrl stage1``: bind at ``bind`` (a fleet's: a port pair per edge) and serve stage0 (every edge)."""
    check_exposure(options, bind, bind=True)
    learners, options = join_learners(settings, options)
    try:
        settings, spec, run_log = prepare(settings, options, STAGE1)
        if settings.schedule.edges > 1 or not learners.alone:
            return _run_fleet_stage1(settings, options, bind, spec, run_log, learners)
    finally:
        learners.close()
    learner = build.make_learner(settings, spec, options)
    with open_link(options, bind, bind=True, peer="stage0") as link:
        log.info("[stage1] listening on %s (%s)", link.endpoint, options.transport)
        resume, rejoining = bool(options.resume), False
        deadline = time.monotonic() + options.start_timeout
        while True:
            try:
                return serve_stage1(learner, link, run_log, start_timeout=max(deadline - time.monotonic(), 0.0),
                                    resume=resume)
            except (PeerGone, HandshakeError) as exc:
                if isinstance(exc, PeerGone) and options.rejoin and link.session is not None:
                    # The iteration in progress is lost with stage0; both go on from their newest common checkpoint.
                    log.warning("[stage1] %s; waiting up to %.0f s for stage0 to rejoin (restarted with --resume %s)",
                                exc, options.rejoin, run_log.dir)
                    resume, rejoining, deadline = True, True, time.monotonic() + options.rejoin
                elif isinstance(exc, HandshakeError):
                    # A failed hello is a stranger's (another run's stage0, a stray client): stage1's answer told
                    # it why; the stage0 this stage1 waits for may still come before the same deadline.
                    log.warning("[stage1] refused a peer whose hello failed (%s); still waiting %.0f s for %s",
                                exc, max(deadline - time.monotonic(), 0.0),
                                "stage0 to rejoin" if rejoining else "stage0")
                else:
                    raise
                link.new_session()
                learner = build.make_learner(settings, spec, options)
