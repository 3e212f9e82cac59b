"""What each side computes, with no link: stage0's `Edge`, stage1's `Learner`, and the training exchange."""

from .edge import EMA_DECAY, Edge
from .exchange import EdgeExchange, FeaturesEdge, FeaturesLearner, LearnerExchange, Sent
from .learner import Learner
from .protocol import KINDS, LIMITS, STAGE0, STAGE1, Payload
from .replica import ReplicaEdge, ReplicaLearner

__all__ = ["EMA_DECAY", "KINDS", "LIMITS", "STAGE0", "STAGE1", "Edge", "EdgeExchange", "FeaturesEdge", "FeaturesLearner",
           "Learner", "LearnerExchange", "Payload", "ReplicaEdge", "ReplicaLearner", "Sent", "edge_exchange",
           "learner_exchange"]


def edge_exchange(edge: Edge) -> EdgeExchange:
    """Stage0's half of the exchange the settings name (``--exchange``)."""
    return ReplicaEdge(edge) if edge.settings.codecs.parsed_exchange().name == "replica" else FeaturesEdge(edge)


def learner_exchange(learner: Learner) -> LearnerExchange:
    """Stage1's half of the exchange the settings name (``--exchange``)."""
    return ReplicaLearner(learner) if learner.settings.codecs.parsed_exchange().name == "replica" else FeaturesLearner(learner)
