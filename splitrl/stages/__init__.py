"""What each side computes, with no link: stage0's `Edge`, stage1's `Learner`, and the training exchange.

The stages' parts live beside them: `update` (the PPO update), `decoupled` (samples an older policy acted
on), `versions` (published policy copies), `rollouts` (the stored rollouts and the env groups that write
them), `env_groups` (stage0's envs), `fleet_encoder` (a fleet's one encoder), `order_free` (acting for a
fleet as its edges come), `door` (what a fleet's stage1 takes from each edge), `exchange` and `replica`
(what crosses the cut in training, seeing each stage through a narrow protocol), `replica_plan` and
`budget` (what the replica sends when; ``--link-budget``, on either stage `budget.CodecTuning`).
"""

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
