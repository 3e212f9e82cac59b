"""Settings: one frozen dataclass per concern, every field with a default and a doc.

Fields that both stages must agree on (`TrainSettings.shared`) go into the
handshake hash. Click options are generated from these fields (splitrl/cli/options.py), so a
field's ``help`` is written once, here.
"""

from __future__ import annotations

import ast
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import SettingsError

__all__ = ["EnvSettings", "PPOSettings", "CodecSettings", "Exchange", "EXCHANGES", "ScheduleSettings", "SCHEDULES", "ENCODER_SYNCS", "EncoderSync", "FLEET_CODECS",
           "option_name", "SettingsError", "TrainSettings", "RunOptions", "ACTION_MAPS", "CUTS", "TRANSPORTS",
           "CODEC_NAMES", "CODEC_STREAMS", "VECTOR_MODES", "doc"]

TRANSPORTS = ("zmq", "tcp", "torch-rpc")
CUTS = ("cnn", "input")
ACTION_MAPS = ("clip", "affine")
CODEC_NAMES = ("fp32", "bf16", "fp16", "int8", "relu", "delta", "paper", "ef", "frames")
"""The codecs of `splitrl.codecs.CODECS`, named here so --help needs no torch import."""
CODEC_STREAMS = {
    "rollout": ("fp32", "bf16", "fp16", "int8", "relu", "frames"),
    "fwd": ("fp32", "bf16", "fp16", "int8", "relu", "delta"),
    "bwd": ("fp32", "bf16", "fp16", "int8", "paper", "ef"),
}
"""Which codecs each stream accepts (each codec's ``streams``), for --help; a test keeps it in step."""
VECTOR_MODES = ("auto", "sync", "async")
"""Where the network is split: after the CNN (the paper's pipeline) or before its
first layer (the paper's "cloud setup": raw observations cross the link)."""


def option_name(f: dataclasses.Field) -> str:
    """The command-line option of a settings field: ``--field-name`` unless the field names another."""
    return "--" + f.metadata.get("option", f.name.replace("_", "-"))


def _argv(settings: Any) -> list[str]:
    """Command-line options for every documented field of a settings dataclass, nested sections included."""
    args: list[str] = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if dataclasses.is_dataclass(value):
            args += _argv(value)
            continue
        name = option_name(f)
        if isinstance(value, bool):
            args.append(name if value else f"--no-{name[2:]}")
        else:
            args += [name, repr(value) if isinstance(value, float) else str(value)]
    return args


def doc(default: Any, help: str, option: str | None = None, *, choices: tuple[str, ...] | None = None,
        link: bool = False) -> Any:
    """A dataclass field with a default and a one-line help text; its option's name if not the field's, the
    values it may take (``choices``), and ``link``: an option of the link between two processes, which the
    single-process twin does not take."""
    meta: dict[str, Any] = {"help": help}
    if option is not None:
        meta["option"] = option
    if choices is not None:
        meta["choices"] = choices
    if link:
        meta["link"] = True
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class EnvSettings:
    """The environment and its observation pipeline (gymnasium's own wrappers)."""

    env_id: str = doc("CarRacing-v3", "gymnasium environment id (image observations, Box actions)")
    num_envs: int = doc(1, "environments stepped in lock step by stage0 (gymnasium SyncVectorEnv)")
    grayscale: bool = doc(True, "convert RGB observations to grayscale")
    frame_stack: int = doc(4, "consecutive frames stacked into one observation")
    resize: int = doc(0, "resize frames to N x N pixels (0: keep the native size)")
    frame_skip: int = doc(1, "repeat each action N times, max-pooling the last two frames (1: no skip)")
    max_episode_steps: int = doc(0, "time limit per episode (0: the environment's own)")
    action_map: str = doc(
        "clip",
        "policy output a in [-1, 1] to the env's Box: 'clip' scales by the largest |bound| and clips "
        "(a = 0 is action 0, e.g. no gas and no brake), 'affine' maps [-1, 1] onto [low, high]",
        choices=ACTION_MAPS,
    )
    env_kwargs: str = doc("", "keyword arguments for gym.make, 'key=value,key=value' (numbers, True/False and None "
                              "as in Python, anything else a string), e.g. 'lap_complete_percent=0.9'")

    def kwargs(self) -> dict[str, Any]:
        """``env_kwargs`` as the dict gym.make takes; SettingsError naming a malformed item."""
        out: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in self.env_kwargs.split(","))):
            key, eq, raw = (part.strip() for part in item.partition("="))
            if not eq or not key.isidentifier():
                raise SettingsError(f"--env-kwargs {self.env_kwargs!r}: {item!r} is not key=value")
            try:
                out[key] = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                out[key] = raw
        return out

    def errors(self) -> list[str]:
        out = []
        try:
            self.kwargs()
        except SettingsError as exc:
            out.append(str(exc))
        for name in ("num_envs", "frame_stack", "frame_skip"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("resize", "max_episode_steps"):
            if getattr(self, name) < 0:
                out.append(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.env_id:
            out.append("--env-id must not be empty")
        if self.action_map not in ACTION_MAPS:
            out.append(f"--action-map must be one of {', '.join(ACTION_MAPS)}, got {self.action_map!r}")
        return out


@dataclass(frozen=True)
class PPOSettings:
    """PPO hyperparameters; the defaults are the paper's."""

    num_steps: int = doc(4096, "environment steps per env per iteration (rollout length)")
    epochs: int = doc(10, "passes over the rollout per iteration")
    minibatches: int = doc(32, "minibatches per epoch")
    gamma: float = doc(0.99, "discount factor")
    gae_lambda: float = doc(0.95, "GAE lambda")
    clip_coef: float = doc(0.2, "PPO ratio clipping")
    clip_vloss: bool = doc(True, "clip the value loss like the policy ratio")
    vf_coef: float = doc(0.5, "value loss coefficient")
    ent_coef: float = doc(0.0, "entropy bonus coefficient")
    norm_adv: bool = doc(True, "normalise advantages per minibatch")
    lr_encoder: float = doc(5e-5, "Adam learning rate of the stage0 encoder")
    lr_heads: float = doc(1e-5, "Adam learning rate of the stage1 actor-critic heads")
    max_grad_norm: float = doc(0.5, "gradient-norm clipping, applied by each stage to its own parameters")
    norm_reward: bool = doc(True, "divide rewards by a running std of the discounted return (gymnasium NormalizeReward)")
    reward_clip: float = doc(10.0, "clip normalised rewards to [-N, N] (0: no clipping)")
    init_log_std: float = doc(-0.5, "initial value of the policy's state-independent log-std (pre-tanh)")
    anneal_lr: bool = doc(False, "anneal both learning rates linearly to 0 over the run (CleanRL's --anneal-lr)")
    target_kl: float = doc(0.0, "end an iteration's epochs early once the approximate KL of an epoch's last "
                                "minibatch exceeds this (CleanRL's --target-kl; 0: never)")

    def lr_fraction(self, iteration: int, num_iterations: int) -> float:
        """The share of each learning rate used in ``iteration`` (1-based): 1, or CleanRL's linear annealing."""
        return 1.0 - (iteration - 1.0) / num_iterations if self.anneal_lr else 1.0

    def errors(self, num_envs: int) -> list[str]:
        out = []
        for name in ("num_steps", "epochs", "minibatches"):
            if getattr(self, name) < 1:
                out.append(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        batch = self.num_steps * num_envs
        if self.minibatches >= 1 and batch % self.minibatches:
            out.append(f"the batch (num_steps x num_envs = {batch}) must divide into --minibatches {self.minibatches}")
        for name in ("gamma", "gae_lambda"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                out.append(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
        if not self.reward_clip >= 0:
            out.append(f"--reward-clip must be >= 0, got {self.reward_clip}")
        if not -5.0 <= self.init_log_std <= 2.0:
            out.append(f"--init-log-std must be in [-5, 2] (the log-std clamp), got {self.init_log_std}")
        for name in ("clip_coef", "lr_encoder", "lr_heads", "max_grad_norm"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                out.append(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if not (self.target_kl >= 0 and math.isfinite(self.target_kl)):
            out.append(f"--target-kl must be >= 0 (0: off), got {self.target_kl}")
        return out


EXCHANGES = ("features", "replica")
SYNC_MODES = ("fp32", "bf16", "int8")
OUTPUT_CODECS = ("fp32", "bf16", "fp16", "int8")
"""The dense codecs that carry the replica exchange's per-sample outputs and their gradient."""


def _named_params(cls: type, spec: str, option: str, names: tuple[str, ...],
                  with_params: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """``NAME[:key=value,...]`` read against the fields of ``cls`` (all but ``name``); only the names in
    ``with_params`` take parameters, and a ``sync`` parameter names a dense codec (`SYNC_MODES`).
    SettingsError naming what is wrong."""
    name, _, params = spec.strip().partition(":")
    if name not in names:
        raise SettingsError(f"{option} {spec!r}: unknown {option[2:].replace('-', ' ')} {name!r} "
                            f"(one of {', '.join(names)})")
    known = {f.name: f.type for f in dataclasses.fields(cls) if f.name != "name"} if name in with_params else {}
    values: dict[str, Any] = {}
    for item in filter(None, params.split(",")):
        key, eq, raw = (part.strip() for part in item.partition("="))
        if not eq or key not in known:
            raise SettingsError(f"{option} {spec!r}: unknown parameter {item!r} for {name!r} "
                                f"(parameters: {', '.join(known) or 'none'})")
        try:
            values[key] = int(raw) if known[key] in (int, "int") else raw
        except ValueError:
            raise SettingsError(f"{option} {spec!r}: {key}={raw!r} is not a whole number") from None
    if values.get("sync", SYNC_MODES[-1]) not in SYNC_MODES:  # a weight sync's codec (`WeightSync`)
        raise SettingsError(f"{option} {spec!r}: sync must be one of {', '.join(SYNC_MODES)}")
    return name, values


@dataclass(frozen=True)
class EncoderSync:
    """How a fleet's edges keep one encoder, parsed from ``--encoder-sync NAME[:key=value,...]``.

    ``grad``: every minibatch, the edges' encoder gradients are summed through stage1 and every edge
    steps with the sum (exact). ``avg``: each edge steps with its own share's gradient, and after every
    ``every``-th minibatch (and each epoch's last) the edges' weights are averaged through stage1, their
    changes since the last average travelling as ``sync`` (`splitrl.stages.weights.WeightSync`).
    """

    name: str = "grad"
    every: int = 8
    """avg: minibatches between averages (counted over the iteration; each epoch's last averages too)."""
    sync: str = "int8"
    """avg: how the weight changes travel (fp32, bf16 or int8 with one scale per row)."""

    @classmethod
    def parse(cls, spec: str) -> "EncoderSync":
        name, values = _named_params(cls, spec, "--encoder-sync", ENCODER_SYNCS, with_params=("avg",))
        sync = cls(name, **values)
        if sync.every < 1:
            raise SettingsError(f"--encoder-sync {spec!r}: every must be >= 1, got {sync.every}")
        return sync

    def due(self, epoch: int, mb: int, minibatches: int) -> bool:
        """Whether the edges average after minibatch (epoch, mb)."""
        return mb == minibatches - 1 or (epoch * minibatches + mb + 1) % self.every == 0


@dataclass(frozen=True)
class Exchange:
    """What crosses the cut in training, parsed from ``--exchange NAME[:key=value,...]``.

    ``features``: the encoder's output and the loss gradient with respect to it.
    ``replica``: stage0 keeps a replica of the heads; the change of the heads' outputs
    since the rollout and the gradient with respect to them (`splitrl.stages.replica`).
    """

    name: str = "features"
    sync: str = "int8"
    """replica: how the heads' weight updates travel (fp32, bf16 or int8 with one scale per row)."""
    last_every: int = 0
    """replica: also update all weights but the two first layers after every N-th training minibatch (0: never)."""
    all_every: int = 0
    """replica: also update all weights after every N-th training minibatch (0: never)."""

    @classmethod
    def parse(cls, spec: str) -> "Exchange":
        """ValueError naming what is wrong."""
        name, values = _named_params(cls, spec, "--exchange", EXCHANGES, with_params=("replica",))
        exchange = cls(name, **values)
        for key in ("last_every", "all_every"):
            if getattr(exchange, key) < 0:
                raise SettingsError(f"--exchange {spec!r}: {key} must be >= 0, got {getattr(exchange, key)}")
        return exchange


@dataclass(frozen=True)
class CodecSettings:
    """What crosses the link: each stream's codec (see `splitrl.codecs`) and the training exchange."""

    codec_rollout: str = doc("fp32", "codec of the rollout features (stage0 -> stage1, every env step)")
    codec_fwd: str = doc("fp32", "codec of what stage0 sends in training (stage0 -> stage1, every minibatch)")
    codec_bwd: str = doc("fp32", "codec of the gradient stage1 sends back in training (every minibatch)")
    exchange: str = doc(
        "features",
        "what crosses the cut in training: 'features' (the encoder's output and its gradient) or "
        "'replica[:sync=int8|bf16|fp32,last_every=N,all_every=N]' (stage0 keeps a replica of the heads, "
        "updated after each rollout and every N minibatches if asked; the change of the heads' outputs "
        "since the rollout and its gradient cross, 4 values a sample; fwd/bwd codecs fp32, bf16, fp16 or int8)",
    )
    link_budget: str = doc(
        "", "a link rate such as 2mbit: each iteration stage0 chooses each stream's setting, from the codec given "
            "down (fewer bits, a lower density, a longer replica period), so that the iteration's bytes each way "
            "fit this rate over the last iteration's compute time; the choices are logged as budget/* "
            "(splitrl.stages.budget)")

    def errors(self, cut: str) -> list[str]:
        from .codecs import parse_codec  # codecs import the transport; settings stay import-light

        out: list[str] = []
        try:
            exchange: Exchange | None = Exchange.parse(self.exchange)
        except ValueError as exc:
            out.append(str(exc))
            exchange = None
        for stream in ("rollout", "fwd", "bwd"):
            spec = getattr(self, f"codec_{stream}")
            if spec.strip().partition(":")[0].partition("+")[0] == "replica":
                out.append(f"--codec-{stream} {spec!r}: replica is an exchange, not a codec: use --exchange "
                           "replica[:sync=...,last_every=N,all_every=N] with --codec-fwd/--codec-bwd "
                           f"{', '.join(OUTPUT_CODECS)}")
                continue
            try:
                codec = parse_codec(spec, stream)
            except ValueError as exc:
                out.append(f"--codec-{stream}: {exc}")
                continue
            base = getattr(codec, "inner", codec).name
            if cut == "input" and stream == "rollout" and base not in ("fp32", "bf16", "fp16", "frames"):
                out.append(f"--codec-rollout {spec!r}: with --cut input the rollout carries uint8 pixels; "
                           "use fp32 (as is), frames, or either +zstd")
            if cut == "input" and stream != "rollout" and codec.spec() != "fp32":
                out.append(f"--codec-{stream} {spec!r}: with --cut input nothing crosses the link in training")
            if cut != "input" and base == "frames":
                out.append("--codec-rollout frames needs --cut input (it sends pixels)")
            if exchange is not None and exchange.name == "replica" and stream != "rollout" \
                    and codec.spec() not in OUTPUT_CODECS:
                out.append(f"--codec-{stream} {spec!r}: with --exchange replica it carries 4 values a sample; "
                           f"use one of {', '.join(OUTPUT_CODECS)}")
        if exchange is not None and exchange.name != "features" and cut == "input":
            out.append(f"--exchange {self.exchange!r}: with --cut input nothing crosses the link in training")
        if self.link_budget:
            from .units import parse_rate

            try:
                parse_rate(self.link_budget)
            except ValueError as exc:
                out.append(f"--link-budget: {exc}")
            if cut == "input":
                out.append("--link-budget needs --cut cnn (with --cut input the rollout carries pixels as they are)")
        return out

    def parsed_exchange(self) -> Exchange:
        return Exchange.parse(self.exchange)

    def specs(self) -> dict[str, str]:
        return {"rollout": self.codec_rollout, "fwd": self.codec_fwd, "bwd": self.codec_bwd}


SCHEDULES = ("sync", "pipelined", "async", "fleet")
ENCODER_SYNCS = ("grad", "avg")
FLEET_CODECS = ("fp32", "bf16", "fp16", "int8", "relu")
"""What a fleet's training features and gradients may go through: codecs without per-sample state, which
would be split across the edges (the rollout stream takes any codec: its state is per env)."""


PUBLISH = ("iteration", "epoch")


@dataclass(frozen=True)
class ScheduleSettings:
    """When each stage works (`splitrl.schedule`): the stages take turns unless these ask for overlap."""

    rollout_groups: str = doc(
        "1", "env groups the rollout cycles through: while stage1 acts for one group, stage0 steps another "
             "(Sample Factory's double-buffered sampling); a divisor of --num-envs, or 'auto' (from the measured "
             "round trip and env step time: K >= 1 + RTT / step time)")
    microbatches: int = doc(
        1, "micro-batches per training minibatch (GPipe): stage0 forwards micro-batch j+1 while stage1 computes "
           "j; gradients add up, one optimizer step per minibatch on each side (codecs that choose per message, "
           "such as ef's top-k, choose per micro-batch)")
    asynchronous: bool = doc(
        False, "train iteration i while the rollout of i+1 runs, acting with the newest finished policy "
               "(swapped in flight); importance-weighted value targets for samples an older policy acted on",
        option="async")
    max_staleness: int = doc(
        1, "with --async: the most policy versions a sample may lag behind the policy that trains on it "
           "(0: none, the rollout waits for training)")
    publish: str = doc(
        "iteration", "with --async: when the trained weights become the acting ones: 'iteration' (when its training "
                     "ends; the rollout takes the newest at each step) or 'epoch' (after every epoch, paced: step t "
                     "of a rollout of T steps acts with the weights after floor(t * E / T) of the E epochs of the "
                     "training beside it, so the rollout spans that training and a sample lags E down to 1 epochs, "
                     "(E + 1) / (2E) of an iteration on average instead of 1; deterministic, but a resumed run's first rollout "
                     "acts with the checkpoint's weights throughout; needs --max-staleness 1)",
        choices=PUBLISH)
    rescore: bool = doc(
        False, "with --async: before an iteration trains, score its rollout once more with the network that "
               "starts training (one more pass of the encoder, its features sent as train_fwd's are): decoupled "
               "PPO's proximal policy, the importance weights and the value baseline all of that network")
    edges: int = doc(
        1, "stage0 processes (edge devices) one stage1 serves, each stepping --num-envs envs; one policy: every "
           "minibatch draws from all edges' samples (an iteration is num_steps x num_envs x edges samples)")
    encoder_sync: str = doc(
        "grad", "with --edges > 1, how the edges keep one encoder: 'grad' sums their encoder gradients through "
                "stage1 every minibatch, so N edges x E envs train as 1 edge x N*E envs in N groups; "
                "'avg[:every=K,sync=int8|bf16|fp32]' lets each edge step alone and averages their weights "
                "through stage1 every K minibatches (default 8) and at each epoch's end, for thin links")

    @property
    def mode(self) -> str:
        """'fleet' (several edges), 'async', 'pipelined' (groups or micro-batches) or 'sync'."""
        if self.edges > 1:
            return "fleet"
        if self.asynchronous:
            return "async"
        return "pipelined" if self.rollout_groups != "1" or self.microbatches != 1 else "sync"

    def parsed_encoder_sync(self) -> EncoderSync:
        return EncoderSync.parse(self.encoder_sync)

    def groups(self, num_envs: int) -> int | None:
        """The number of env groups (None for 'auto', decided once the round trip is measured)."""
        return None if self.rollout_groups == "auto" else int(self.rollout_groups)

    def errors(self, num_envs: int, minibatch: int, codecs: "CodecSettings", cut: str) -> list[str]:
        out = []
        if self.rollout_groups != "auto":
            try:
                groups = int(self.rollout_groups)
            except ValueError:
                groups = 0
            if groups < 1 or num_envs % groups:
                out.append(f"--rollout-groups must be 'auto' or a divisor of --num-envs {num_envs} (each group "
                           f"steps the same number of envs), got {self.rollout_groups!r}")
        if self.microbatches < 1 or (minibatch >= 1 and minibatch % self.microbatches):
            out.append(f"--microbatches must be >= 1 and divide the minibatch ({minibatch} samples), "
                       f"got {self.microbatches}")
        specs = codecs.specs()
        if self.microbatches > 1 and any(spec.startswith("paper") for spec in specs.values()):
            out.append("--microbatches > 1 cannot carry the paper codec: its accumulator is positional over "
                       "a whole minibatch's rows")
        if self.max_staleness < 0:
            out.append(f"--max-staleness must be >= 0, got {self.max_staleness}")
        if self.edges < 1:
            out.append(f"--edges must be >= 1, got {self.edges}")
        try:
            EncoderSync.parse(self.encoder_sync)
        except SettingsError as exc:
            out.append(str(exc))
        if self.edges > 1:
            if codecs.link_budget:
                out.append("--link-budget works with one edge (--edges 1): each edge would choose on its own")
            if self.rollout_groups != "1" or self.microbatches != 1 or self.asynchronous:
                out.append("--edges > 1 runs the fleet's own schedule: --rollout-groups 1, --microbatches 1, "
                           "no --async (the edges themselves are the groups)")
            if codecs.exchange.partition(":")[0] != "features":
                out.append("--edges > 1 works with --exchange features only")
            odd = [f"--codec-{stream} {spec}" for stream, spec in specs.items()
                   if stream != "rollout" and spec.partition(":")[0].partition("+")[0] not in FLEET_CODECS]
            if odd:
                out.append(f"--edges > 1 takes the training codecs {', '.join(FLEET_CODECS)} only (per-sample state "
                           f"would be split across the edges): {', '.join(odd)}")
        if self.publish not in PUBLISH:
            out.append(f"--publish must be one of {', '.join(PUBLISH)}, got {self.publish!r}")
        elif self.publish == "epoch":
            if not self.asynchronous or self.max_staleness != 1:
                out.append("--publish epoch paces an asynchronous rollout against the one training beside it: "
                           "it needs --async --max-staleness 1")
            if cut == "input":
                out.append("--publish epoch needs --cut cnn (with --cut input stage1 trains alone, and stage0 sees "
                           "no epochs to act on)")
        if self.rescore and not self.asynchronous:
            out.append("--rescore works with --async only (without it no sample lags)")
        if self.asynchronous:
            if codecs.exchange.partition(":")[0] != "features":
                out.append("--async works with --exchange features only (the replica's view and its updates "
                           "belong to one rollout at a time)")
            if any(spec.startswith("delta") for spec in specs.values()):
                out.append("--async cannot carry the delta codec (its cache is the one rollout being trained on)")
        return out


BOTTLENECK_TRAINING = ("ppo", "autoencoder")


@dataclass(frozen=True)
class TrainSettings:
    """Everything both stages must agree on; hashed in the handshake."""

    seed: int = doc(1, "seed of the environments, the initial weights, action sampling and minibatch order")
    total_steps: int = doc(409_600, "environment steps to train for (the paper: 100 iterations of 4096)")
    cut: str = doc("cnn", "where the network is split: 'cnn' (after the encoder) or 'input' (cloud setup)",
                   choices=CUTS)
    bottleneck: int = doc(0, "K > 0: the encoder ends with a learned linear projection of its 4096 features to K "
                             "values (the heads' first layers take K), trained end to end: the rollout's and "
                             "training's traffic and the replica's first layers shrink with K (0: none)")
    bottleneck_train: str = doc("ppo", "how --bottleneck's projection learns: 'ppo' (end to end, with the loss) or "
                                "'autoencoder' (the paper's literal variant: stage1 fits it with a decoder to "
                                "reconstruct the 4096 features, ships it to stage0; the heads see the decoder's "
                                "reconstruction)", choices=BOTTLENECK_TRAINING)
    autoencoder_every: int = doc(16, "--bottleneck-train autoencoder: stage0 sends the 4096 features of every Nth "
                                     "rollout step (int8+zstd), the samples stage1 fits the autoencoder on")
    env: EnvSettings = field(default_factory=EnvSettings)
    ppo: PPOSettings = field(default_factory=PPOSettings)
    codecs: CodecSettings = field(default_factory=CodecSettings)
    schedule: ScheduleSettings = field(default_factory=ScheduleSettings)

    @property
    def steps_per_iteration(self) -> int:
        """Samples an iteration collects: every edge's envs' rollouts."""
        return self.ppo.num_steps * self.total_envs

    @property
    def total_envs(self) -> int:
        """The envs of all edges (`ScheduleSettings.edges` x `EnvSettings.num_envs`)."""
        return self.env.num_envs * self.schedule.edges

    def fleet_view(self) -> "TrainSettings":
        """What stage1 of a fleet learns as: one edge with every edge's envs, each edge's a group (so a fleet of
        N edges x E envs trains as 1 edge x N*E envs in N groups)."""
        if self.schedule.edges == 1:
            return self
        return dataclasses.replace(
            self, env=dataclasses.replace(self.env, num_envs=self.total_envs),
            schedule=dataclasses.replace(self.schedule, edges=1, rollout_groups=str(self.schedule.edges)))

    @property
    def versions_per_iteration(self) -> int:
        """Policy versions one iteration's training publishes (`ScheduleSettings.publish`): an acting version
        counts epochs with --publish epoch, iterations otherwise."""
        return self.ppo.epochs if self.schedule.publish == "epoch" else 1

    @property
    def num_iterations(self) -> int:
        return self.total_steps // self.steps_per_iteration

    def errors(self) -> list[str]:
        out = self.env.errors() + self.ppo.errors(self.total_envs) + self.codecs.errors(self.cut)
        minibatch = self.steps_per_iteration // self.ppo.minibatches if self.ppo.minibatches >= 1 else 0
        out += self.schedule.errors(self.env.num_envs, minibatch, self.codecs, self.cut)
        if self.cut not in CUTS:
            out.append(f"--cut must be one of {', '.join(CUTS)}, got {self.cut!r}")
        if self.seed < 0:
            out.append(f"--seed must be >= 0, got {self.seed}")
        if self.bottleneck < 0:
            out.append(f"--bottleneck must be >= 0 (0: none), got {self.bottleneck}")
        out += self._autoencoder_errors()
        if not out and self.num_iterations < 1:
            out.append(
                f"--total-steps {self.total_steps} is less than one iteration "
                f"(num_steps x num_envs x edges = {self.steps_per_iteration})"
            )
        elif not out and self.total_steps % self.steps_per_iteration:
            size, below = self.steps_per_iteration, self.num_iterations * self.steps_per_iteration
            out.append(f"--total-steps {self.total_steps} is not a whole number of iterations of {size} steps "
                       f"(num_steps x num_envs x edges): use {below} or {below + size}")
        return out

    def _autoencoder_errors(self) -> list[str]:
        if self.bottleneck_train not in BOTTLENECK_TRAINING:
            return [f"--bottleneck-train must be one of {', '.join(BOTTLENECK_TRAINING)}, got {self.bottleneck_train!r}"]
        if self.bottleneck_train != "autoencoder":
            every = TrainSettings.__dataclass_fields__["autoencoder_every"].default
            return [] if self.autoencoder_every == every else [
                "--autoencoder-every applies to --bottleneck-train autoencoder only"]
        out = []
        if self.autoencoder_every < 1:
            out.append(f"--autoencoder-every must be >= 1, got {self.autoencoder_every}")
        if not self.bottleneck or self.cut != "cnn":
            out.append("--bottleneck-train autoencoder needs --bottleneck K and --cut cnn")
        # The fitted projection reaches stage0 with the replica's update after each rollout.
        if self.codecs.exchange.partition(":")[0] != "replica":
            out.append("--bottleneck-train autoencoder needs --exchange replica (its projection travels with the "
                       "replica's update after each rollout)")
        if self.schedule.edges > 1:
            out.append("--bottleneck-train autoencoder runs one edge (a fleet would average a projection that "
                       "stage1 fits)")
        if self.codecs.link_budget:
            out.append("--bottleneck-train autoencoder cannot run with --link-budget yet (the budget does not count "
                       "the samples and the projection's updates)")
        return out

    def validate(self, options: "RunOptions | None" = None) -> "TrainSettings":
        """Raise one ValueError listing every problem (with ``options``' too), or return self."""
        problems = self.errors() + (options.errors() if options is not None else [])
        if options is not None and options.edge_id >= self.schedule.edges:
            problems.append(f"--edge-id {options.edge_id}: the fleet has --edges {self.schedule.edges} "
                            f"(ids 0 .. {self.schedule.edges - 1})")
        if options is not None and options.min_edges > self.schedule.edges:
            problems.append(f"--min-edges {options.min_edges}: the fleet has --edges {self.schedule.edges}")
        if options is not None and options.learners > 1:
            if self.schedule.edges < options.learners:
                problems.append(f"--learners {options.learners} serve a fleet of at least as many edges, got --edges "
                                f"{self.schedule.edges}")
            if options.min_edges not in (0, self.schedule.edges) or options.rejoin:
                problems.append("--min-edges and --rejoin work with one learner (--learners 1): across learners an "
                                "edge lost ends the run")
            if self.cut == "input" or self.bottleneck_train == "autoencoder":
                problems.append("--learners > 1 needs the samples' features to stay with each learner's edges: not "
                                "--cut input (stage1 would train alone on every edge's frames) nor --bottleneck-train "
                                "autoencoder (its fit would see one learner's samples)")
        if options is not None and self.schedule.edges > 1:
            if options.transport != "zmq":
                problems.append(f"--edges > 1 runs over --transport zmq only, got {options.transport}")
        if problems:
            raise SettingsError("invalid settings:\n  - " + "\n  - ".join(problems))
        return self

    def shared(self) -> dict[str, Any]:
        """Flat ``section.field -> value`` map for the handshake."""
        flat: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                for g in dataclasses.fields(value):
                    flat[f"{f.name}.{g.name}"] = getattr(value, g.name)
            else:
                flat[f.name] = value
        return flat

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainSettings":
        """The settings `to_dict` wrote (a run's config); fields it lacks (an older run) take their defaults,
        a field it has that these settings do not know is an error."""
        sections = {f.name: f.default_factory for f in dataclasses.fields(cls)
                    if f.default_factory is not dataclasses.MISSING}  # the nested settings

        def build(kind: Any, values: dict[str, Any], where: str) -> Any:
            known = {f.name for f in dataclasses.fields(kind)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise SettingsError(f"settings{where}: unknown field(s) {', '.join(unknown)} (a newer splitrl's run?)")
            return kind(**values)

        top = {k: v for k, v in data.items() if k not in sections}
        nested = {k: build(kind, data.get(k, {}), f".{k}") for k, kind in sections.items()}
        return build(cls, {**top, **nested}, "")

    def to_argv(self) -> list[str]:
        """The command-line options that rebuild these settings (``splitrl stage0 ... ARGV``)."""
        return _argv(self)


@dataclass(frozen=True)
class RunOptions:
    """Per-process options that the stages need not agree on."""

    run_dir: str = doc("", "directory for config, metrics, episodes and checkpoints (default: runs/<time>-<env>); "
                           "one that holds a run already is refused unless --resume or --overwrite")
    resume: str = doc("", "continue the run in this directory from the newest checkpoint both stages have")
    overwrite: bool = doc(False, "start a new run in a --run-dir that holds one (its metrics, episodes and "
                                 "checkpoints are deleted)")
    keep_checkpoints: int = doc(2, "newest checkpoints kept per stage (0: all)")
    timeout: float = doc(60.0, "seconds to wait for any message from the peer before giving up")
    start_timeout: float = doc(300.0, "seconds to wait for the peer to appear at start-up")
    checkpoint_every: int = doc(1, "save both stages every N iterations (0: only at the end); what --resume "
                                   "continues from")
    threads: int = doc(0, "torch intra-op threads (0: torch's default)")
    vector: str = doc("auto", "how stage0 steps its environments: 'sync' in its own process, 'async' in one "
                              "worker process each (gymnasium AsyncVectorEnv), so encoding and the link overlap them; "
                              "'auto': async where it measured faster (4 or more envs), else sync",
                      choices=VECTOR_MODES)
    transport: str = doc("zmq", "the link: 'zmq' (ZeroMQ PUSH/PULL), 'tcp' (plain sockets, same frames), or 'torch-rpc' "
                          "(PyTorch RPC, the paper's link; loopback benchmarks only); both sides alike",
                         choices=TRANSPORTS, link=True)
    curve: str = doc("", "key directory (`splitrl keys DIR`): the link is encrypted with ZeroMQ CURVE, stage1 accepts "
                         "only the edge keys in DIR/authorized, stage0 only the server key DIR/stage1.key", link=True)
    curve_name: str = doc("stage0", "stage0: which key pair of --curve DIR is this edge's (DIR/NAME.key_secret; "
                                    "`splitrl keys DIR --name NAME` makes more, one per edge of a fleet)", link=True)
    insecure: bool = doc(False, "allow a link beyond this machine without --curve: anyone who reaches the ports can "
                                "drive the learner or read the traffic", link=True)
    heartbeat: float = doc(5.0, "seconds after which a peer whose connection closed or went silent counts as dead "
                                "(ZeroMQ heartbeats, TCP keepalive; 0: only --timeout)", link=True)
    rejoin: float = doc(0.0, "stage1: when stage0 is lost mid-run, wait this many seconds for a restarted stage0 "
                             "(`--resume`) to continue from the newest checkpoint both hold (0: exit at once); of "
                             "a fleet, with fewer than --min-edges edges left, wait this long at the iteration's end "
                             "for edges to join",
                        link=True)
    min_edges: int = doc(0, "stage1 of a fleet: when an edge dies, goes silent past --timeout or breaks the "
                             "protocol, drop it and train on with the rest while at least this many remain (its "
                             "samples left out from then on); below it, stage1 waits --rejoin seconds at the "
                             "iteration's end for edges to join; 0: every edge",
                         link=True)
    act_wait: str = doc("all", "stage1 of a fleet: how long the first edge's step waits for the other edges' before "
                               "one forward of the heads acts for those there: 'all' waits for every edge (lock step: "
                               "N edges act as 1 edge in N groups, bit for bit), or milliseconds (e.g. 2): edges go "
                               "at their own pace, and each edge's actions are drawn from a generator of its own step, "
                               "so the run does not depend on who came when", link=True)
    learners: int = doc(1, "stage1 of a fleet as this many data-parallel learner processes (torch.distributed, "
                           "gloo), each serving --edges / LEARNERS of the edges and all holding the same heads: "
                           "`splitrl run` starts them with torchrun; a stage1 started by `torchrun --nproc-per-node "
                           "LEARNERS -m splitrl stage1` is told by torchrun", link=True)
    edge_id: int = doc(-1, "stage0 of a fleet (--edges > 1): which edge this is, 0 .. edges - 1 (stage1's port pair "
                           "PORT + 2 x ID); -1: the first one free", link=True)
    eval_every: int = doc(0, "stage0: score the policy every N iterations (and after the last) on --eval-episodes "
                             "held-out episodes, as `splitrl eval` does; eval/return_mean and eval/return_std in "
                             "metrics.jsonl (0: never)")
    eval_episodes: int = doc(5, "episodes of each evaluation during training")
    tensorboard: bool = doc(False, "stage0: also write every metric to TensorBoard event files in the run directory "
                                   "as each iteration ends (both stages' keys)")

    def act_wait_seconds(self) -> float | None:
        """``--act-wait`` in seconds; None for 'all' (lock step); NaN if it is neither."""
        if self.act_wait == "all":
            return None
        try:
            return float(self.act_wait) / 1000.0
        except ValueError:
            return float("nan")

    def errors(self) -> list[str]:
        out = []
        if not self.timeout > 0:
            out.append(f"--timeout must be > 0, got {self.timeout}")
        if not self.start_timeout > 0:
            out.append(f"--start-timeout must be > 0, got {self.start_timeout}")
        if self.act_wait_seconds() is not None and not self.act_wait_seconds() >= 0:
            out.append(f"--act-wait must be 'all' or milliseconds >= 0, got {self.act_wait!r}")
        if self.checkpoint_every < 0:
            out.append(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if self.transport not in TRANSPORTS:
            out.append(f"--transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if self.threads < 0:
            out.append(f"--threads must be >= 0, got {self.threads}")
        if self.keep_checkpoints < 0:
            out.append(f"--keep-checkpoints must be >= 0, got {self.keep_checkpoints}")
        if self.resume and self.overwrite:
            out.append("--resume and --overwrite contradict each other")
        if self.resume and self.run_dir and self.run_dir != self.resume:
            out.append(f"--resume {self.resume} continues the run there: --run-dir must be the same or not given")
        if self.curve and self.transport != "zmq":
            out.append(f"--curve needs --transport zmq (the {self.transport} transport has no encryption: it stays on "
                       "this machine unless --insecure)")
        if self.heartbeat < 0:
            out.append(f"--heartbeat must be >= 0, got {self.heartbeat}")
        if self.rejoin < 0:
            out.append(f"--rejoin must be >= 0, got {self.rejoin}")
        if self.rejoin and not self.checkpoint_every:
            out.append("--rejoin continues from a checkpoint: it needs --checkpoint-every >= 1")
        if self.rejoin and not self.heartbeat:
            out.append("--rejoin needs --heartbeat > 0: that is how a lost stage0 is noticed")
        if self.vector not in VECTOR_MODES:
            out.append(f"--vector must be one of {', '.join(VECTOR_MODES)}, got {self.vector!r}")
        if self.min_edges < 0:
            out.append(f"--min-edges must be >= 0, got {self.min_edges}")
        if self.learners < 1:
            out.append(f"--learners must be >= 1, got {self.learners}")
        if self.edge_id < -1:
            out.append(f"--edge-id must be >= 0 (or -1: the first free), got {self.edge_id}")
        if self.eval_every < 0:
            out.append(f"--eval-every must be >= 0, got {self.eval_every}")
        if self.eval_episodes < 1:
            out.append(f"--eval-episodes must be >= 1, got {self.eval_episodes}")
        return out

    def to_argv(self) -> list[str]:
        """The command-line options that rebuild these options."""
        return _argv(self)
