"""The agent's network: any model, built whole from a seed and cut in two.

- `network`: the model interface: a factory of (observation space, action space, **kwargs) gives the encoder as
  named layers (a `Network`); ``--model`` names a built-in or ``module:factory``; resolving ``--cut``; a Dict
  observation's vector carried beside the image's layers and joined to their features (`with_vector`)
- `builtin`: the built-in models: `nature` (the paper's, the default), `impala`, `mlp`
- `heads`: `ActorCriticHeads`, stage1's actor and critic after the layers past the cut
- `layers`: `layer_init` and `ScaleObs`, shared by the built-ins and the heads; `ImageStep` (a Dict's layers)
- `build`: `build_agent` / `agent`: the encoder, an optional ``--bottleneck`` projection and the heads from one
  seed, cut into (stage0's module, stage1's heads)
"""

from .build import agent, build_agent, crossing, cuts, network_digest, spaces
from .builtin import impala, mlp, nature
from .heads import SCORING_ROWS, ActorCriticHeads
from .layers import ScaleObs, layer_init
from .network import BUILTINS, DEFAULT, INPUT, Factory, Network, make_network, resolve_model, with_vector

__all__ = ["ScaleObs", "ActorCriticHeads", "agent", "build_agent", "cuts", "crossing", "layer_init", "SCORING_ROWS", "Network",
           "Factory", "BUILTINS", "INPUT", "DEFAULT", "resolve_model", "make_network", "network_digest", "spaces",
           "nature", "impala", "mlp", "with_vector"]
