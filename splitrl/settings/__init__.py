"""Settings: one frozen dataclass per concern, every field with a default, a doc and the values it may take.

- `options`: the field machinery (`doc`), the option names, the one check of every declared range and choice
- `sections`: the dataclasses (`TrainSettings` and its sections, both stages agree on them; `RunOptions`)
- `specs`: parsers of the options that are small languages (codec specs, ``--exchange``, ``--env-kwargs``,
  ``--model``)
- `rules`: the one table of rules that tie several options together
- `resume`: what a resumed run takes from its directory, and the run-time options it may be given again

Fields that both stages must agree on (`TrainSettings.shared`) go into the handshake hash. Click options are
generated from these fields (splitrl/cli/options.py), so a field's ``help`` is written once, with the field.
"""

from ..errors import SettingsError
from .options import doc, field_errors, option_name
from .resume import RUNTIME, resumed
from .rules import RULES, Rule
from .sections import (ACTION_MAPS, BOTTLENECK_TRAINING, CUTS, PUBLISH, SCHEDULES, TRANSPORTS, VECTOR_MODES,
                       TRACK_MISSING, CodecSettings, EnvSettings, PPOSettings, RunOptions, ScheduleSettings,
                       TrainSettings, installed)
from .specs import (CODEC_NAMES, CODEC_STREAMS, ENCODER_SYNCS, EXCHANGES, FLEET_CODECS, MODEL_NAMES, OUTPUT_CODECS,
                    SYNC_MODES, EncoderSync, Exchange)

__all__ = ["EnvSettings", "PPOSettings", "CodecSettings", "Exchange", "EXCHANGES", "ScheduleSettings", "SCHEDULES",
           "ENCODER_SYNCS", "EncoderSync", "FLEET_CODECS", "option_name", "SettingsError", "TrainSettings",
           "RunOptions", "ACTION_MAPS", "CUTS", "TRANSPORTS", "CODEC_NAMES", "CODEC_STREAMS", "VECTOR_MODES", "doc",
           "field_errors", "Rule", "RULES", "PUBLISH", "BOTTLENECK_TRAINING", "SYNC_MODES", "OUTPUT_CODECS",
           "MODEL_NAMES", "TRACK_MISSING", "installed", "RUNTIME", "resumed"]
