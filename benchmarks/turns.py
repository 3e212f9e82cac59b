"""What taking turns between two processes costs a synchronous rollout, with nothing else around it.

    python benchmarks/turns.py --steps 1024 --rounds 3 [--links pipe,socket,zmq,splitrl,tcp]

The synchronous split's rollout is one env stepped by stage0, the encoder's forward on its observation, the
features to stage1, the heads' forward and draw there, the action back: 4,096 round trips an iteration, each side
asleep while the other works. `splitrl bench floor` times these parts in one process, one after the other
(``one process``). Here the same parts (the paper's env pipeline and networks, one intra-op thread a process) also
run in two processes that take turns at every step over a link (``two processes``), one of ``--links``:

- ``pipe``: a pipe, raw bytes each way and nothing else (no framing, checks, storage or codec);
- ``socket``: a TCP loopback socket, raw bytes each way behind a 4-byte length, read and written by each side's
  own thread (no I/O thread, no framing): what a network link costs with nothing of ZeroMQ's or splitrl's;
- ``zmq``: a ZeroMQ PUSH/PULL pair over TCP loopback, as the split's, raw bytes each way (a short header frame
  and the tensor's bytes, copied into a tensor as received);
- ``splitrl``: splitrl's own link (`ZmqTransport` over TCP loopback), each step a wire message as the synchronous
  split sends it (the features and the env's reward and flags; the action back), framed, checked and decoded, in
  a session as the handshake leaves it;
- ``tcp``: the same messages over splitrl's plain TCP link (`TcpTransport`, ``--transport tcp``): one socket
  each way read and written by the stage's own thread, where ZeroMQ hands every message to its I/O thread.

The settings alternate for ``--rounds`` rounds. Printed per setting, in microseconds a step: each part's thread
CPU, the processes' CPU in all, and the rest (``turns``: the link's calls, sleeping and waking, and whatever each
part costs more for having slept). Between the links, the difference in ``turns`` is what each layer costs a
step: ZeroMQ's over a pipe, splitrl's framing and checks over ZeroMQ's. The split's rollout costs what the last
does, plus what splitrl adds around the parts (the steps' storage and bookkeeping; `docs/benchmarks/floor.md`).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

PARTS = ("env", "encoder", "heads")
LINKS = ("pipe", "socket", "zmq", "splitrl", "tcp")
START = b"start"
"""The edge's word that its warm-up is over (features are thousands of bytes; an empty message stops the heads)."""
HOST = "tcp://127.0.0.1"
SESSION = 1 << 16
"""The session id splitrl's links carry, as if stage1's hello had set it (it draws one from [2^16, 2^32)): with a
session, a transport's decoder learns its peer's layouts and checks a message like one before only in what
varies (`splitrl.transport.fastwire`), as the split's do; without, every message takes the whole check."""


class _Raw:
    """Raw bytes each way, the features out and the action back; a subclass moves them (`send`, `recv`). `START`
    says the edge's clocks start, an empty message that it stops. The edge's side: `start`, `ask`, `observed`,
    `stop`; the heads': `next_features`, `reply`, `close`."""

    def send(self, data: bytes) -> None:
        raise NotImplementedError

    def recv(self) -> bytes:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self.send(START)
        self.recv()

    def ask(self, features):
        """The action the heads' side draws for ``features``."""
        import torch

        self.send(features.numpy().tobytes())
        return torch.frombuffer(bytearray(self.recv()), dtype=torch.float32).view(1, -1)

    def observed(self, reward, terminated, truncated) -> None:
        """The env's outcome of the step just taken: raw bytes carry none."""

    def stop(self) -> None:
        self.send(b"")
        self.close()

    def next_features(self):
        """The next features that come, `START` when the edge's clocks start (answered), None once it stops."""
        import torch

        data = self.recv()
        if not data:
            return None
        if data == START:
            self.send(START)
            return START
        return torch.frombuffer(bytearray(data), dtype=torch.float32).view(1, -1)

    def reply(self, action) -> None:
        self.send(action.numpy().tobytes())


class _Pipe(_Raw):
    """A `multiprocessing` pipe's end."""

    def __init__(self, conn) -> None:
        self.send, self.recv, self.close = conn.send_bytes, conn.recv_bytes, conn.close


class _Socket(_Raw):
    """A TCP loopback connection, each message its length (4 bytes) then its bytes; the heads' side listens
    (``port`` None) and reports its port."""

    def __init__(self, port, report=None) -> None:
        import socket

        if port is None:
            with socket.create_server(("127.0.0.1", 0)) as server:
                server.settimeout(60)
                report.put(server.getsockname()[1])
                self.sock, _ = server.accept()
        else:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.settimeout(60)  # no receive waits forever
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, data: bytes) -> None:
        self.sock.sendall(len(data).to_bytes(4, "little") + data)

    def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise ConnectionError("the other side closed")
            got += k
        return buf

    def recv(self) -> bytes:
        return bytes(self._exactly(int.from_bytes(self._exactly(4), "little")))

    def close(self) -> None:
        self.sock.close()


class _Zmq(_Raw):
    """A ZeroMQ PUSH/PULL pair over TCP loopback: a 16-byte header frame, then the bytes (what a message of one
    tensor costs the sockets); the heads' side binds (``ports`` None) and reports its two ports."""

    HEADER = bytes(16)

    def __init__(self, ports, report=None) -> None:
        import zmq

        self.more = zmq.SNDMORE
        self.ctx = zmq.Context()
        self.pull, self.push = self.ctx.socket(zmq.PULL), self.ctx.socket(zmq.PUSH)
        self.pull.setsockopt(zmq.RCVTIMEO, 60_000)  # no receive waits forever
        if ports is None:
            report.put((self.pull.bind_to_random_port(HOST), self.push.bind_to_random_port(HOST)))
        else:
            self.push.connect(f"{HOST}:{ports[0]}")
            self.pull.connect(f"{HOST}:{ports[1]}")

    def send(self, data: bytes) -> None:
        self.push.send(self.HEADER, self.more)
        self.push.send(data)

    def recv(self) -> bytes:
        return self.pull.recv_multipart()[-1]

    def close(self) -> None:
        self.ctx.destroy(linger=5000)  # the last message (the stop) still goes out; at most 5 s


def open_link(endpoint, report=None, tcp: bool = False):
    """splitrl's link over TCP loopback in a session, as the handshake leaves it (each end learns the other's
    layouts): a `ZmqTransport`, or with ``tcp`` a `TcpTransport`. The heads' side binds (``endpoint`` None) and
    reports where to ``report``."""
    from splitrl.transport import TcpTransport, ZmqTransport

    link = (TcpTransport if tcp else ZmqTransport)(endpoint or f"{HOST}:0", bind=endpoint is None, timeout=60.0)
    link.session = SESSION
    if report is not None:
        report.put(link.endpoint)
    return link


class _Framed:
    """splitrl's link, a `ZmqTransport` (``tcp``: a `TcpTransport`; the heads' side binds, ``endpoint`` None, and
    reports where) in a session: each step the wire message the synchronous split sends (the features, the env's
    reward and flags) and the action back, framed, checked and decoded as the stages do. The sides of `_Raw`, over
    ``start``, ``step``, ``action`` and ``close`` messages."""

    def __init__(self, endpoint, report=None, tcp: bool = False) -> None:
        import torch

        from splitrl.schedule.common import expect

        self.torch, self.expect = torch, expect
        self.link = open_link(endpoint, report, tcp)
        self.outcome = {"reward": torch.zeros(1), "terminated": torch.zeros(1, dtype=torch.bool),
                        "truncated": torch.zeros(1, dtype=torch.bool)}
        self.t = 0

    def start(self) -> None:
        self.link.send("start")
        self.expect(self.link, "start")

    def ask(self, features):
        self.link.send("step", {"features": features, **self.outcome}, {"t": self.t})
        action = self.expect(self.link, "action", t=self.t).tensors["action"]
        self.t += 1
        return action

    def observed(self, reward, terminated, truncated) -> None:
        """What the next step carries, as tensors (the split's edge keeps them so too)."""
        from_numpy = self.torch.from_numpy
        self.outcome = {"reward": from_numpy(reward.astype("float32")), "terminated": from_numpy(terminated),
                        "truncated": from_numpy(truncated)}

    def stop(self) -> None:
        self.link.send("close")
        self.close()

    def next_features(self):
        msg = self.link.recv()
        if msg.kind == "close":
            return None
        if msg.kind == "start":
            self.link.send("start")
            return START
        self.t = msg.header["t"]
        return msg.tensors["features"]

    def reply(self, action) -> None:
        self.link.send("action", {"action": action}, {"t": self.t})

    def close(self) -> None:
        self.link.close()


def _open(link: str, peer, report=None):
    """One side of a link of `LINKS`: ``peer`` is the pipe's end, or where the heads' side listens (None on that
    side, which reports it to ``report``)."""
    if link == "pipe":
        return _Pipe(peer)
    if link == "socket":
        return _Socket(peer, report)
    return _Zmq(peer, report) if link == "zmq" else _Framed(peer, report, tcp=link == "tcp")


def _build():
    """The paper's settings as a run resolves them, its env's spec and both halves of its network, on one thread."""
    import torch

    from splitrl.envs import inspect_env
    from splitrl.models import agent
    from splitrl.settings import TrainSettings

    torch.set_num_threads(1)
    settings = TrainSettings()
    spec = inspect_env(settings.env)
    settings = settings.for_observation(spec.observation)
    return (settings, spec, *agent(settings, spec))


def _edge(link: str | None, peer, steps: int, out) -> None:
    """The env and the encoder; the heads in this process (``link`` None) or across a link of `LINKS` to the
    heads' process (``peer``: see `_open`)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as `python -m splitrl` runs, before torch loads
    import torch

    from splitrl.stages.env_groups import training_envs

    settings, spec, encoder, heads = _build()
    other = None if link is None else _open(link, peer)
    envs, _ = training_envs(settings)
    stacked = settings.env.image_pipeline[1] > 1
    generator = torch.Generator().manual_seed(settings.seed)
    obs, _ = envs.reset(seed=settings.seed)
    seconds = dict.fromkeys(PARTS, 0.0)

    def step() -> None:
        nonlocal obs
        clock = time.thread_time()
        x = torch.as_tensor(spec.rows(obs, stacked))
        with torch.no_grad():
            features = encoder(x)
            now = time.thread_time()
            seconds["encoder"] += now - clock
            if other is None:
                action = heads.evaluate(*heads.outputs(features), generator=generator)[0]
                clock = time.thread_time()
                seconds["heads"] += clock - now
            else:
                action = other.ask(features)
                clock = time.thread_time()
        obs, reward, terminated, truncated, _ = envs.step(spec.env_action(action.numpy(), settings.env.action_map))
        seconds["env"] += time.thread_time() - clock
        if other is not None:
            other.observed(reward, terminated, truncated)

    for _ in range(8):  # warm-up: allocations, oneDNN's primitives
        step()
    if other is not None:  # both sides' clocks start here
        other.start()
    seconds.update(dict.fromkeys(PARTS, 0.0))
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    envs.close()
    if other is not None:
        other.stop()  # the heads' side stops
    out.put(("edge", cpu, wall, seconds))


def _heads(link: str, peer, out, report) -> None:
    """The heads' forward and draw for each features that come, the action back, until the edge stops."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    settings, _, _, heads = _build()
    generator = torch.Generator().manual_seed(settings.seed)
    other = _open(link, peer, report)
    seconds, cpu = 0.0, time.process_time()
    while (features := other.next_features()) is not None:
        if features is START:  # the edge's warm-up is over
            seconds, cpu = 0.0, time.process_time()
            continue
        clock = time.thread_time()
        with torch.no_grad():
            action = heads.evaluate(*heads.outputs(features), generator=generator)[0]
        seconds += time.thread_time() - clock
        other.reply(action)
    out.put(("heads", time.process_time() - cpu, 0.0, {"heads": seconds}))
    other.close()


def _get(queue, sides, timeout: float):
    """The next item of ``queue``, within ``timeout`` seconds; a side that died first fails it at once."""
    import queue as queues

    deadline = time.monotonic() + timeout
    while True:
        try:
            return queue.get(timeout=1)
        except queues.Empty:
            dead = [p.exitcode for p in sides if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a side exited with status {dead[0]} (its traceback is above)") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no result in {timeout:.0f} s") from None


def run_sides(edge, heads, link: str | None, edge_args: tuple, heads_args: tuple = ()) -> list:
    """What the sides put on the results queue: ``edge`` alone (``link`` None), called ``edge(None, None,
    *edge_args, results)``, or ``heads(link, peer, *heads_args, results, report)`` and ``edge(link, peer,
    *edge_args, results)`` in processes of their own, joined by ``link`` (a pipe's two ends, or where the heads'
    side reports it listens). Fresh interpreters (spawn), each stopped in the end."""
    ctx = mp.get_context("spawn")
    results, report = ctx.Queue(), ctx.Queue()
    sides = []
    try:
        if link is None:
            sides.append(ctx.Process(target=edge, args=(None, None, *edge_args, results)))
            sides[0].start()
        else:
            a, b = ctx.Pipe() if link == "pipe" else (None, None)
            sides.append(ctx.Process(target=heads, args=(link, b, *heads_args, results, report)))
            sides[0].start()
            peer = a if link == "pipe" else _get(report, sides, 300)  # where the heads' side listens
            sides.append(ctx.Process(target=edge, args=(link, peer, *edge_args, results)))
            sides[1].start()
        return [_get(results, sides, 900) for _ in sides]
    finally:
        for p in sides:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def measure(steps: int, link: str | None) -> dict[str, float]:
    """One setting: CPU seconds by part, the processes' CPU in all and the edge's wall seconds over ``steps``; the
    heads in the edge's process (``link`` None) or in their own across a link of `LINKS`."""
    parts = dict.fromkeys(PARTS, 0.0)
    cpu = wall = 0.0
    for role, role_cpu, role_wall, seconds in run_sides(_edge, _heads, link, (steps,)):
        cpu += role_cpu
        wall = max(wall, role_wall)
        for part, s in seconds.items():
            parts[part] += s
    return {**parts, "cpu": cpu, "wall": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--links", default="pipe", help=f"comma-separated, of {', '.join(LINKS)}")
    args = parser.parse_args()
    links = args.links.split(",")
    if not links or any(link not in LINKS for link in links):
        parser.error(f"--links: each of {', '.join(LINKS)}, got {args.links!r}")
    settings = [("one process", None), *((f"two processes, {link}", link) for link in links)]
    us = 1e6 / args.steps
    print(f"{args.steps} env steps a setting, one intra-op thread a process; microseconds a step")
    print("| setting | env | encoder | heads | parts | CPU in all | turns | wall |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        for name, link in settings[:: 1 if r % 2 == 0 else -1]:
            m = measure(args.steps, link)
            parts = sum(m[p] for p in PARTS)
            print(f"| {name} | {m['env'] * us:.0f} | {m['encoder'] * us:.0f} | {m['heads'] * us:.0f} | "
                  f"{parts * us:.0f} | {m['cpu'] * us:.0f} | {(m['cpu'] - parts) * us:.0f} | {m['wall'] * us:.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
