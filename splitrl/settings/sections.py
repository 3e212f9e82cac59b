"""The settings dataclasses: the training settings both stages must agree on (`TrainSettings` and its
sections), and a process's own options (`RunOptions`).

Each field is declared once with `options.doc`: its default, its one-line doc (the click option's help,
splitrl/cli/options.py) and the values it may take. `errors` reports every problem at once: each field
against its declaration (`options.field_errors`), then the rules that tie options together (`rules.RULES`).
Fields that both stages must agree on (`TrainSettings.shared`) go into the handshake hash.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ..devices import check_device_name, device_error
from ..errors import SettingsError
from ..runs import default_run_dir
from .options import doc, field_errors, to_argv
from .rules import rule_errors
from .specs import (AUTO_MODEL, AUTO_MODELS, MODEL_NAMES, EncoderSync, Exchange, check_model, codec_spec,
                    parse_env_kwargs, parse_link_budget, parse_model_kwargs)

__all__ = ["EnvSettings", "PPOSettings", "CodecSettings", "ScheduleSettings", "TrainSettings", "RunOptions",
           "TRANSPORTS", "CUTS", "ACTION_MAPS", "VECTOR_MODES", "SCHEDULES", "PUBLISH", "BOTTLENECK_TRAINING",
           "TRACK_MISSING", "installed"]

TRACK_MISSING = "--track needs the wandb package: pip install -c constraints.txt -e '.[wandb]' (the wandb extra)"


def installed(package: str) -> bool:
    """Whether ``package`` imports (imported only for an option that needs it: the settings stay import-light)."""
    try:
        importlib.import_module(package)
    except ImportError:
        return False
    return True


TRANSPORTS = ("zmq", "tcp", "torch-rpc")
CUTS = ("cnn", "input")
"""The cuts every model has: its default ('cnn': for the paper's network, after the CNN) and before its first
layer ('input': the paper's "cloud setup", raw observations cross the link); ``--cut`` also takes a layer's name
or number (`splitrl.models.network`)."""
ACTION_MAPS = ("clip", "affine")
VECTOR_MODES = ("auto", "sync", "async")


@dataclass(frozen=True)
class EnvSettings:
    """The environment and its observation pipeline (gymnasium's own wrappers)."""

    env_id: str = doc("CarRacing-v3", "gymnasium environment id (image, state-vector, or Dict of an image and vectors "
                                      "observations; Box or Discrete actions)", nonempty=True)
    num_envs: int = doc(1, "environments stepped in lock step by stage0 (gymnasium SyncVectorEnv)", min=1)
    grayscale: bool | None = doc(None, "convert RGB observations to grayscale (unset: on for image observations; "
                                       "images only)")
    frame_stack: int | None = doc(None, "consecutive frames stacked into one observation (unset: 4 for image "
                                        "observations; images only)", min=1)
    resize: int = doc(0, "resize frames to N x N pixels (0: keep the native size; images only)", min=0)
    frame_skip: int = doc(1, "repeat each action N times, max-pooling the last two frames (1: no skip; images "
                             "only)", min=1)
    max_episode_steps: int = doc(0, "time limit per episode (0: the environment's own)", min=0)
    action_map: str = doc(
        "clip",
        "policy output a in [-1, 1] to the env's Box: 'clip' scales by the largest |bound| and clips "
        "(a = 0 is action 0, e.g. no gas and no brake), 'affine' maps [-1, 1] onto [low, high]",
        choices=ACTION_MAPS,
    )
    env_kwargs: str = doc("", "keyword arguments for gym.make, 'key=value,key=value' (numbers, True/False and None "
                              "as in Python, anything else a string), e.g. 'lap_complete_percent=0.9'",
                          spec=parse_env_kwargs)

    def kwargs(self) -> dict[str, Any]:
        """``env_kwargs`` as the dict gym.make takes; SettingsError naming a malformed item."""
        return parse_env_kwargs(self.env_kwargs)

    @property
    def image_pipeline(self) -> tuple[bool, int]:
        """(grayscale, frames stacked) of image observations: as set, or the defaults (on, 4) where unset."""
        grayscale = True if self.grayscale is None else self.grayscale
        return grayscale, 4 if self.frame_stack is None else self.frame_stack

    def image_options(self) -> list[str]:
        """The image-only options set to change the observations (an error for observations that are no image;
        unset, or set to do nothing, they are not applied)."""
        asked = (("--grayscale", bool(self.grayscale)), ("--frame-stack", (self.frame_stack or 1) > 1),
                 ("--resize", self.resize > 0), ("--frame-skip", self.frame_skip > 1))
        return [name for name, on in asked if on]

    def for_observation(self, kind: str) -> "EnvSettings":
        """These settings with the image options' defaults filled in for observations of ``kind`` ('image',
        'vector' or 'dict'): on and 4 for images, off and 1 for the others."""
        grayscale, stack = self.image_pipeline if kind == "image" else (bool(self.grayscale), self.frame_stack or 1)
        return dataclasses.replace(self, grayscale=grayscale, frame_stack=stack)


@dataclass(frozen=True)
class PPOSettings:
    """PPO hyperparameters; the defaults are the paper's."""

    num_steps: int = doc(4096, "environment steps per env per iteration (rollout length)", min=1)
    epochs: int = doc(10, "passes over the rollout per iteration", min=1)
    minibatches: int = doc(32, "minibatches per epoch", min=1)
    gamma: float = doc(0.99, "discount factor", min=0.0, max=1.0)
    gae_lambda: float = doc(0.95, "GAE lambda", min=0.0, max=1.0)
    clip_coef: float = doc(0.2, "PPO ratio clipping", above=0.0, finite=True)
    clip_vloss: bool = doc(True, "clip the value loss like the policy ratio")
    vf_coef: float = doc(0.5, "value loss coefficient")
    ent_coef: float = doc(0.0, "entropy bonus coefficient")
    norm_adv: bool = doc(True, "normalise advantages per minibatch")
    lr_encoder: float = doc(5e-5, "Adam learning rate of the stage0 encoder", above=0.0, finite=True)
    lr_heads: float = doc(1e-5, "Adam learning rate of the stage1 actor-critic heads", above=0.0,
                           finite=True)
    lr_log_std: float = doc(0.0, "Adam learning rate of the policy's log-std (0: --lr-heads, as the paper; at "
                                 "1e-5 the spread barely moves over a run)", min=0.0, finite=True, note="0: --lr-heads")
    log_std_floor: float = doc(-5.0, "the least value the policy's log-std learns to: set back to it after any step "
                                     "that takes it lower (-5: the clamp's own, as the paper)", min=-5.0, max=2.0,
                                note="-5: no floor but the clamp")
    fused_adam: bool = doc(False, "step PPO's Adam (encoder and heads) with torch's fused kernel, one pass over each "
                                  "tensor (on CPU the heads' "
                                  "step on one thread 17 -> 3 ms); not bit for bit the default's values (the last "
                                  "bits of a step differ)")
    max_grad_norm: float = doc(0.5, "gradient-norm clipping, applied by each stage to its own parameters",
                              above=0.0, finite=True)
    norm_reward: bool = doc(True, "divide rewards by a running std of the discounted return (gymnasium NormalizeReward)")
    reward_clip: float = doc(10.0, "clip normalised rewards to [-N, N] (0: no clipping)", min=0.0)
    init_log_std: float = doc(-0.5, "initial value of the policy's state-independent log-std (pre-tanh)",
                               min=-5.0, max=2.0, note="the log-std clamp")
    anneal_lr: bool = doc(False, "anneal both learning rates linearly to 0 over the run (CleanRL's --anneal-lr)")
    target_kl: float = doc(0.0, "end an iteration's epochs early once the approximate KL of an epoch's last "
                                "minibatch exceeds this (CleanRL's --target-kl; 0: never)",
                                min=0.0, finite=True, note="0: off")

    def lr_fraction(self, iteration: int, num_iterations: int) -> float:
        """The share of each learning rate used in ``iteration`` (1-based): 1, or CleanRL's linear annealing."""
        return 1.0 - (iteration - 1.0) / num_iterations if self.anneal_lr else 1.0


@dataclass(frozen=True)
class CodecSettings:
    """What crosses the link: each stream's codec (see `splitrl.codecs`) and the training exchange."""

    codec_rollout: str = doc("fp32", "codec of the rollout features (stage0 -> stage1, every env step)",
                             spec=codec_spec("rollout"))
    codec_fwd: str = doc("fp32", "codec of what stage0 sends in training (stage0 -> stage1, every minibatch)",
                         spec=codec_spec("fwd"))
    codec_bwd: str = doc("fp32", "codec of the gradient stage1 sends back in training (every minibatch)",
                         spec=codec_spec("bwd"))
    exchange: str = doc(
        "features",
        "what crosses the cut in training: 'features' (the encoder's output and its gradient) or "
        "'replica[:sync=int8|bf16|fp32,last_every=N,all_every=N]' (stage0 keeps a replica of the heads, "
        "updated after each rollout and every N minibatches if asked; the change of the heads' outputs "
        "since the rollout and its gradient cross, 4 values a sample; fwd/bwd codecs fp32, bf16, fp16 or int8)",
        spec=Exchange.parse,
    )
    link_budget: str = doc(
        "", "a link rate such as 2mbit: each iteration stage0 chooses each stream's setting, from the codec given "
            "down (fewer bits, a lower density, a longer replica period), so that the iteration's bytes each way "
            "fit this rate over the last iteration's compute time; the choices are logged as budget/* "
            "(splitrl.stages.budget)", spec=parse_link_budget)

    def errors(self, cut: str) -> list[str]:
        """Every problem of the codecs with ``cut`` (`TrainSettings.errors` reports these with the rest)."""
        return field_errors(self) + rule_errors("codecs", TrainSettings(cut=cut, codecs=self))

    def parsed_exchange(self) -> Exchange:
        return Exchange.parse(self.exchange)

    def specs(self) -> dict[str, str]:
        return {"rollout": self.codec_rollout, "fwd": self.codec_fwd, "bwd": self.codec_bwd}


SCHEDULES = ("sync", "pipelined", "async", "fleet")
PUBLISH = ("iteration", "epoch")


@dataclass(frozen=True)
class ScheduleSettings:
    """When each stage works (`splitrl.schedule`): the stages take turns unless these ask for overlap."""

    rollout_groups: str = doc(
        "1", "env groups the rollout cycles through: while stage1 acts for one group, stage0 steps another "
             "(Sample Factory's double-buffered sampling); a divisor of --num-envs, or 'auto' (from the measured "
             "round trip and env step time: K >= 1 + RTT / step time)")
    microbatches: int = doc(
        1, "micro-batches per training minibatch (GPipe): stage1 computes micro-batch j while stage0 forwards "
           "j+1, each stage taking its micro-batches at once on --part-workers threads; gradients add up, one "
           "optimizer step per minibatch on each side (codecs that choose per message, such as ef's top-k, choose "
           "per micro-batch)", min=1)
    asynchronous: bool = doc(
        False, "train iteration i while the rollout of i+1 runs, acting with the newest finished policy "
               "(swapped in flight); importance-weighted value targets for samples an older policy acted on",
        option="async")
    max_staleness: int = doc(
        1, "with --async: the most policy versions a sample may lag behind the policy that trains on it "
           "(0: none, the rollout waits for training)", min=0)
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
           "minibatch draws from all edges' samples (an iteration is num_steps x num_envs x edges samples)", min=1)
    encoder_sync: str = doc(
        "grad", "with --edges > 1, how the edges keep one encoder: 'grad' sums their encoder gradients through "
                "stage1 every minibatch, so N edges x E envs train as 1 edge x N*E envs in N groups; "
                "'avg[:every=K,sync=int8|bf16|fp32]' lets each edge step alone and averages their weights "
                "through stage1 every K minibatches (default 8) and at each epoch's end, for thin links; either takes "
                "clip=NORM (each edge's gradient or change scaled to at most NORM before they are added; default 0: "
                "off) and robust=trimmed|median (each coordinate's trimmed mean or median over the edges instead of "
                "their sum or mean: one of 3 or more edges cannot move the encoder far; default off)",
        spec=EncoderSync.parse)
    edge_reward_limit: float = doc(
        1e6, "stage1: the largest |reward| it takes from stage0 (each edge of a fleet); a larger one is that edge's "
             "error, naming it and the tensor: a fleet drops the edge while --min-edges remain, otherwise the run "
             "ends (inf: no limit)", above=0.0)
    edge_feature_limit: float = doc(
        1e6, "stage1: the largest |value| of the features it takes from stage0 (with --cut input, of the float "
             "observations), as decoded, in the rollout and in training; beyond it, as --edge-reward-limit",
        above=0.0)
    edge_grad_limit: float = doc(
        1e6, "stage1 of a fleet: the largest L2 norm of an edge's encoder gradient (encoder_grad) or change "
             "(encoder_avg); beyond it, as --edge-reward-limit (to scale a large one down instead: --encoder-sync "
             "grad:clip=NORM)", above=0.0)

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


BOTTLENECK_TRAINING = ("ppo", "autoencoder")


@dataclass(frozen=True)
class TrainSettings:
    """Everything both stages must agree on; hashed in the handshake."""

    seed: int = doc(1, "seed of the environments, the initial weights, action sampling and minibatch order", min=0)
    total_steps: int = doc(409_600, "environment steps to train for (the paper: 100 iterations of 4096)")
    model: str = doc(AUTO_MODEL, f"the network: a built-in ({', '.join(MODEL_NAMES)}; nature is the paper's), a "
                                 "factory of your own as module:factory (docs/guides/network.md), or "
                                 f"'{AUTO_MODEL}': {AUTO_MODELS['image']} for image and Dict observations, "
                                 f"{AUTO_MODELS['vector']} for vectors", spec=check_model)
    model_kwargs: str = doc("", "keyword arguments of --model's factory, 'key=value,key=value' (as --env-kwargs), "
                                "e.g. 'width=8,blocks=1' for impala", spec=parse_model_kwargs)
    cut: str = doc("cnn", "where the network is split: 'cnn' (the model's default: after the encoder), 'input' "
                          "(cloud setup), or after a layer of the model, by name or number (0 is 'input')",
                   nonempty=True)
    hidden: int = doc(512, "width of the actor's and the critic's hidden layer", min=1)
    bottleneck: int = doc(0, "K > 0: the encoder ends with a learned linear projection of its 4096 features to K "
                             "values (the heads' first layers take K), trained end to end: the rollout's and "
                             "training's traffic and the replica's first layers shrink with K (0: none)", min=0,
                    note="0: none")
    bottleneck_train: str = doc("ppo", "how --bottleneck's projection learns: 'ppo' (end to end, with the loss) or "
                                "'autoencoder' (the paper's literal variant: stage1 fits it with a decoder to "
                                "reconstruct the 4096 features, ships it to stage0; the heads see the decoder's "
                                "reconstruction)", choices=BOTTLENECK_TRAINING)
    autoencoder_every: int = doc(16, "--bottleneck-train autoencoder: stage0 sends the 4096 features of every Nth "
                                     "rollout step (int8+zstd), the samples stage1 fits the autoencoder on", min=1)
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

    def for_observation(self, kind: str) -> "TrainSettings":
        """These settings with the defaults that depend on the observations filled in for observations of ``kind``
        ('image', 'vector' or 'dict'): the image options (`EnvSettings.for_observation`) and ``--model auto``
        (`AUTO_MODELS`). A run's config holds them so: what ran, and the same for a run made before they
        depended on the observations."""
        model = AUTO_MODELS[kind] if self.model == AUTO_MODEL else self.model
        return dataclasses.replace(self, model=model, env=self.env.for_observation(kind))

    def errors(self) -> list[str]:
        """Every problem of these settings: each field against its declaration, then the rules; the run's
        length only once all else holds (it divides by what the others check)."""
        out = field_errors(self) + rule_errors("codecs", self) + rule_errors("train", self)
        return out or rule_errors("last", self)

    def validate(self, options: "RunOptions | None" = None) -> "TrainSettings":
        """Raise one ValueError listing every problem (with ``options``' too), or return self."""
        problems = self.errors()
        if options is not None:
            problems += options.errors() + rule_errors("launch", self, options)
        if problems:
            raise SettingsError(SettingsError.HEAD + "\n  - ".join(problems))
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
        """The settings `to_dict` wrote (a run's config); fields it lacks take their defaults (run configs under
        docs/results lack options they did not use), a field it has that these settings do not know is an error."""
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
        return to_argv(self)


@dataclass(frozen=True)
class RunOptions:
    """Per-process options that the stages need not agree on."""

    run_dir: str = doc("", "directory for config, metrics, episodes and checkpoints (default: runs/<time>-<env>); "
                           "one that holds a run already is refused unless --resume or --overwrite")
    resume: str = doc("", "continue the run in this directory from the newest checkpoint both stages have, with the "
                          "settings it was started with (only --total-steps and run-time options such as --timeout "
                          "may be given again)")
    overwrite: bool = doc(False, "start a new run in a --run-dir that holds one (its metrics, episodes and "
                                 "checkpoints are deleted)")
    keep_checkpoints: int = doc(2, "newest checkpoints kept per stage (0: all)", min=0)
    timeout: float = doc(60.0, "seconds to wait for any message from the peer before giving up", above=0.0)
    start_timeout: float = doc(300.0, "seconds to wait for the peer to appear at start-up", above=0.0)
    checkpoint_every: int = doc(1, "save both stages every N iterations (0: only at the end); what --resume "
                                   "continues from", min=0)
    threads: int = doc(0, "torch intra-op threads (0: torch's default)", min=0)
    part_workers: int = doc(0, "threads that take a minibatch's micro-batches (--microbatches) through a stage's "
                               "network at once, with the numbers they get one after another (0: as many as this "
                               "machine's cores hold --threads threads each, so one with torch's default threads; "
                               "1: one after another)", min=0)
    channels_last: bool = doc(False, "each stage runs its network's 2-d convolutions on channels-last (NHWC) inputs, "
                                     "which torch's CPU kernels train faster: the same maths, its float32 sums in "
                                     "another order (weights, checkpoints and the wire as they are)")
    stage0_device: str = doc("cpu", "where stage0 computes (its encoder, optimizer and rollout storage; the envs step "
                                    "on the CPU either way): cpu, cuda, cuda:N, or auto (cuda where this machine has "
                                    "one, else cpu); this stage's own choice, not in the handshake (`splitrl stage0 "
                                    "--device` says the same)", option="stage0-device",
                             spec=partial(check_device_name, option="--stage0-device"))
    stage1_device: str = doc("cpu", "where stage1 computes (the heads, the PPO learner, its optimizer and rollout "
                                    "storage): cpu, cuda, cuda:N, or auto (cuda where this machine has one, else "
                                    "cpu); this stage's own choice, not in the handshake (`splitrl stage1 --device` "
                                    "says the same)", option="stage1-device",
                             spec=partial(check_device_name, option="--stage1-device"))
    vector: str = doc("auto", "how stage0 steps its environments: 'sync' in its own process, 'async' in one "
                              "worker process each (gymnasium AsyncVectorEnv), so encoding and the link overlap them; "
                              "'auto': async where it measured faster (4 or more envs), else sync",
                      choices=VECTOR_MODES)
    env_nice: int = doc(10, "with worker envs (--vector async): run them this much nicer than stage0, as `nice -n` "
                            "does (0: as stage0), so that the stages' own threads, whose turn the rollout waits "
                            "for, take a core before an env step that has time to spare; it changes no number",
                        min=0, max=19)
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
                                "(ZeroMQ heartbeats, TCP keepalive; 0: only --timeout)", link=True, min=0.0)
    rejoin: float = doc(0.0, "stage1: when stage0 is lost mid-run, wait this many seconds for a restarted stage0 "
                             "(`--resume`) to continue from the newest checkpoint both hold (0: exit at once); of "
                             "a fleet, with fewer than --min-edges edges left, wait this long at the iteration's end "
                             "for edges to join",
                        link=True, min=0.0)
    min_edges: int = doc(0, "stage1 of a fleet: when an edge dies, goes silent past --timeout or breaks the "
                             "protocol, drop it and train on with the rest while at least this many remain (its "
                             "samples left out from then on); below it, stage1 waits --rejoin seconds at the "
                             "iteration's end for edges to join; 0: every edge",
                         link=True, min=0)
    act_wait: str = doc("all", "stage1 of a fleet: how long the first edge's step waits for the other edges' before "
                               "one forward of the heads acts for those there: 'all' waits for every edge (lock step: "
                               "N edges act as 1 edge in N groups, bit for bit), or milliseconds (e.g. 2): edges go "
                               "at their own pace, and each edge's actions are drawn from a generator of its own step, "
                               "so the run does not depend on who came when", link=True)
    learners: int = doc(1, "stage1 of a fleet as this many data-parallel learner processes (torch.distributed, "
                           "gloo), each serving --edges / LEARNERS of the edges and all holding the same heads: "
                           "`splitrl run` starts them with torchrun; a stage1 started by `torchrun --nproc-per-node "
                           "LEARNERS -m splitrl stage1` is told by torchrun", link=True, min=1)
    edge_id: int = doc(-1, "stage0 of a fleet (--edges > 1): which edge this is, 0 .. edges - 1 (stage1's port pair "
                           "PORT + 2 x ID); -1: the first one free", link=True, min=-1,
                      note="-1: the first free")
    eval_every: int = doc(0, "stage0: score the policy every N iterations (and after the last) on --eval-episodes "
                             "held-out episodes, as `splitrl eval` does; eval/return_mean and eval/return_std in "
                             "metrics.jsonl (0: never)", min=0)
    eval_episodes: int = doc(5, "episodes of each evaluation during training", min=1)
    tensorboard: bool = doc(False, "stage0: also write every metric to TensorBoard event files in the run directory "
                                   "as each iteration ends (both stages' keys)")
    capture_video: bool = doc(False, "stage0: record the first episode of every --video-every-th evaluation during "
                                     "training (and of the last) as an mp4 in RUN_DIR/videos/, as `splitrl eval "
                                     "--video` does; needs --eval-every")
    video_every: int = doc(1, "with --capture-video: record every Nth evaluation's episode", min=1)
    track: bool = doc(False, "stage0: also log the metrics to Weights & Biases as each iteration ends, with CleanRL's "
                             "keys and the link's bytes as link/* (CleanRL's --track; needs the wandb extra)")
    wandb_project_name: str = doc("splitrl", "with --track: the W&B project")
    wandb_entity: str = doc("", "with --track: the W&B entity, a team or user (empty: your default one)")

    def act_wait_seconds(self) -> float | None:
        """``--act-wait`` in seconds; None for 'all' (lock step); NaN if it is neither."""
        if self.act_wait == "all":
            return None
        try:
            return float(self.act_wait) / 1000.0
        except ValueError:
            return float("nan")

    def run_dir_for(self, env_id: str) -> str:
        """The run directory: --resume's, else --run-dir, else a new one under runs/ named after the time and
        ``env_id`` (each call a new name: place it once, `dataclasses.replace(options, run_dir=...)`)."""
        return self.resume or self.run_dir or default_run_dir(env_id)

    def device(self, role: str) -> str:
        """The device ``role`` (stage0 or stage1) computes on, as given (`splitrl.devices.resolve_device` reads it)."""
        return getattr(self, f"{role}_device")

    def device_errors(self, *roles: str, option: str | None = None) -> list[str]:
        """Why this machine cannot compute where each of ``roles`` is asked to (imports torch for a CUDA device):
        checked where the stage runs, before any socket opens, and by ``splitrl run`` for both stages before it
        starts them. ``option``: the option the messages name (default ``--ROLE-device``)."""
        out = []
        for role in roles:
            try:
                check_device_name(self.device(role))
            except SettingsError:
                continue  # not a device's name: the field's own check says so
            message = device_error(self.device(role), option or f"--{role}-device")
            out += [message] if message else []
        return out

    def errors(self) -> list[str]:
        """Every problem of these options alone (`TrainSettings.validate` checks them against the settings)."""
        return field_errors(self) + rule_errors("options", None, self) + self.package_errors()

    def package_errors(self) -> list[str]:
        """What this machine lacks for the options asked: the optional packages they need, each message naming
        the extra that installs it."""
        return [TRACK_MISSING] if self.track and not installed("wandb") else []

    def to_argv(self) -> list[str]:
        """The command-line options that rebuild these options."""
        return to_argv(self)
