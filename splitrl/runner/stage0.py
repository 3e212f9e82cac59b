"""Stage0 as a process: the link to stage1 (or to a fleet's place), the handshake, resuming or joining, the
schedule's loop, and stopping cleanly.

Any error is sent to stage1 as ``abort`` before it propagates, so stage1 stops too instead of waiting out
its timeout.
"""

from __future__ import annotations

import logging
from typing import Any

from ..runs import load_checkpoint, read_metrics, truncate_logs
from ..schedule.common import after_progress
from ..settings import RunOptions, TrainSettings
from ..stages import STAGE0, STAGE1, Edge, edge_exchange
from ..stages.evaluate import Evaluation
from ..transport import ProtocolError, Transport
from ..transport.errors import peer_repr
from ..transport.handshake import handshake
from . import build
from .joining import join_fleet
from .links import check_exposure, open_link
from .rundir import prepare, recorded_checkpoints, resume_point

__all__ = ["serve_stage0", "run_stage0"]

log = logging.getLogger(__name__)


def serve_stage0(edge: Edge, link: Transport, *, checkpoint_every: int = 10, start_timeout: float | None = None,
                 resume: bool = False, evaluation: Evaluation | None = None) -> list[dict[str, Any]]:
    """Handshake, every iteration (from the newest checkpoint both stages have, with ``resume``), close.
    Returns the metrics records."""
    try:
        exchange = edge_exchange(edge)
        ours = recorded_checkpoints(edge.run_log.dir) if resume else []
        extra = {**({"checkpoints": ours} if resume else {}),
                 **({"edge": edge.edge} if edge.settings.schedule.edges > 1 else {})}
        hello = handshake(link, STAGE0, STAGE1, edge.settings.shared(), timeout=start_timeout, extra=extra or None)
        join_after = hello.get("join_after", 0) if edge.settings.schedule.edges > 1 else 0
        if join_after:  # a fleet that has trained: start from one of its edges' encoder
            if type(join_after) is not int or not 0 < join_after < edge.settings.num_iterations:
                raise ProtocolError(f"hello: join_after must be an iteration of the run, got {peer_repr(join_after)}")
            # stage1's progress messages come first while it waits for more edges, trains, or the sharing edge
            # scores the policy; joining is part of starting: --start-timeout
            state = after_progress(link, "encoder_state", start_timeout, iteration=join_after)
            edge.join(state, join_after)
            log.info("[stage0] joined the fleet after its iteration %d", join_after)
        if resume and join_after:
            # It joined the running fleet with another edge's encoder: its own records and checkpoints after the
            # join are of another past; they go, and the run goes on appending from the join.
            resume = False
            truncate_logs(edge.run_log.dir, join_after)
            edge.run_log.drop_checkpoints_after(STAGE0, join_after)
            log.info("[stage0] its own checkpoints are not used: it joined the fleet after iteration %d", join_after)
        resumed = None  # the checkpoint this run goes on from
        if resume:
            iteration = resume_point(hello, ours)
            if edge.settings.schedule.edges > 1:
                # The fleet's point is common to stage1 and every edge: stage1 says it once all are in.
                header = after_progress(link, "resume", start_timeout).header
                said = header.get("iteration")
                if type(said) is not int or said < 0 or (said and said not in ours):
                    raise ProtocolError(f"resume: stage1 resumes the fleet after iteration {peer_repr(said)}; this "
                                        f"edge has checkpoints of {ours or 'none'}")
                iteration = said
                if "link" in header:  # this edge's place numbers on from stage1's checkpoint, as stage1 does now
                    try:
                        link.go_on_from(header["link"])
                    except ValueError as exc:
                        raise ProtocolError(f"resume: {exc}") from None
            if iteration:
                resumed = load_checkpoint(edge.run_log.dir, STAGE0, iteration)
                edge.load_state_dict(resumed)
                exchange.load_state_dict(resumed["exchange"])
            truncate_logs(edge.run_log.dir, iteration)
            if edge.tuning.budget is not None and iteration:
                edge.tuning.last_record = edge.tuning.budget.resume(read_metrics(edge.run_log.dir))
            log.info("[stage0] resuming after iteration %d", iteration)
        schedule = build.SCHEDULES[edge.settings.schedule.mode]
        measured = schedule.stage0_open(edge, link)
        if resumed is not None:
            # The run's byte counters go on from the checkpoint's, as if it had not stopped: this session's
            # opening (the hellos; the overlapping schedules' pings and plan) is left out of them, and (one stage1,
            # which numbers on too) its numbering goes on (a fleet's edge: from stage1's word, above).
            aside = sum(v for k, v in link.meter.restore(resumed["meter"]).items() if k.endswith("_bytes"))
            log.info("[stage0] this session's opening, %d bytes, is not in the run's byte counters", aside)
            if "link" in resumed and edge.settings.schedule.edges == 1:
                link.go_on_from(resumed["link"])
        try:
            records = schedule.stage0_loop(edge, exchange, link, measured=measured, checkpoint_every=checkpoint_every,
                                           evaluation=evaluation)
        finally:
            edge.close()
        link.send("close")
    except BaseException as exc:
        link.abort(f"stage0 failed: {type(exc).__name__}: {exc}")
        raise
    return records


def run_stage0(settings: TrainSettings, options: RunOptions, connect: str) -> list[dict[str, Any]]:
    """``splitrl stage0``: connect to stage1 at ``connect`` (a fleet's edge: to a place of its own) and train."""
    check_exposure(options, connect, bind=False)
    settings, spec, run_log = prepare(settings, options, STAGE0)
    edges = settings.schedule.edges
    try:
        if edges > 1:
            log.info("[stage0] joining the fleet of stage1 at %s", connect)
            link, edge_id = join_fleet(options, connect, edges)
            log.info("[stage0] edge %d of %d", edge_id, edges)
        else:
            edge_id = 0
            log.info("[stage0] connecting to stage1 at %s", connect)
            link = open_link(options, connect, bind=False, peer=f"stage1 at {connect}")
        with link:
            edge = build.make_edge(settings, spec, run_log, options, edge_id)
            return serve_stage0(edge, link, checkpoint_every=options.checkpoint_every,
                                start_timeout=options.start_timeout, resume=bool(options.resume),
                                evaluation=build.make_evaluation(settings, spec, options, run_log.dir))
    finally:
        run_log.close()
