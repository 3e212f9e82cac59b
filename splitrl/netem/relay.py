"""A TCP relay that holds every chunk for a delay: link latency where the kernel has no netem.

tc's netem qdisc delays packets; a kernel without sch_netem has none (tbf shapes
the rate only). The relay sits between a client and its server, as toxiproxy's
latency toxic does: for each connection it accepts it opens one to the server,
and in each direction writes every chunk it reads ``delay`` seconds (plus, with
``jitter``, a uniform draw in [-jitter, +jitter]) after reading it. Order is
kept: a chunk is never written before the one read before it, so jitter
stretches gaps but never reorders (unlike netem's jitter without ``rate``).

Limits, to be honest about what this emulates:

- TCP only, and per chunk as read: one ``recv`` may gather several segments that
  arrived within it, and they share one timestamp (at lab rates a chunk is one or
  a few segments);
- the delay is added on top of the real link's (loopback or a veth pair), and the
  relay's own scheduling adds tens to hundreds of microseconds;
- no loss or reordering; TCP's own behaviour (slow start, the window against the
  bandwidth-delay product) happens on two shorter connections instead of one long
  one, and the relay buffers up to ``buffer_bytes`` per direction before it stops
  reading (then the sender sees TCP back-pressure).

Run it where the client runs (the lab starts it in stage0's namespace):
``python -m splitrl.netem.relay --listen 127.0.0.1:5555,5556 --to 10.213.0.1 --delay 10ms``.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import sys
from typing import Sequence

from .tc import parse_time

__all__ = ["Relay", "main"]

log = logging.getLogger(__name__)

CHUNK_BYTES = 65536
BUFFER_BYTES = 8 * 1024 * 1024
"""Per direction of a connection: what the relay holds before it stops reading (chunks of at most 64 KiB)."""


class Relay:
    """Forward ``listen_host:port`` to ``to_host:port`` for each port, each chunk held ``delay`` (+- ``jitter``) s."""

    def __init__(self, listen_host: str, ports: Sequence[int], to_host: str, delay: float, jitter: float = 0.0,
                 seed: int = 0, buffer_bytes: int = BUFFER_BYTES) -> None:
        if delay < 0 or jitter < 0 or jitter > delay:
            raise ValueError(f"need 0 <= jitter <= delay, got delay {delay} s, jitter {jitter} s")
        self.listen_host, self.ports, self.to_host = listen_host, list(ports), to_host
        self.delay, self.jitter = delay, jitter
        self.rng = random.Random(seed)
        self.queue_chunks = max(1, buffer_bytes // CHUNK_BYTES)
        self.servers: list[asyncio.base_events.Server] = []

    async def start(self) -> None:
        for port in self.ports:
            self.servers.append(await asyncio.start_server(
                lambda r, w, port=port: self._connection(r, w, port), self.listen_host, port))

    async def serve_forever(self) -> None:
        """Serve until cancelled (`start` first)."""
        log.info("relay %s:%s -> %s, delay %.1f ms +- %.1f ms", self.listen_host, self.ports, self.to_host,
                 1e3 * self.delay, 1e3 * self.jitter)
        await asyncio.gather(*(s.serve_forever() for s in self.servers))

    async def _connection(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter, port: int) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(self.to_host, port)
        except OSError as exc:
            log.debug("relay: cannot reach %s:%d: %s", self.to_host, port, exc)  # the client retries
            client_w.close()
            return
        try:
            await asyncio.gather(self._direction(client_r, server_w), self._direction(server_r, client_w))
        finally:
            for writer in (client_w, server_w):
                writer.close()

    async def _direction(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read chunks, write each at its due time, in order; the EOF goes through with the same delay
        (a half-close: the other direction goes on). If writing fails, reading stops too."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(self.queue_chunks)

        async def read() -> None:
            last_due = 0.0
            while True:
                try:
                    data = await reader.read(CHUNK_BYTES)
                except (ConnectionError, OSError):
                    data = b""
                due = loop.time() + self.delay + (self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0)
                last_due = max(due, last_due)  # never before the chunk read before it
                await queue.put((last_due, data))
                if not data:
                    return

        async def write() -> None:
            while True:
                due, data = await queue.get()
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        reading = asyncio.ensure_future(read())
        try:
            await write()
        except (ConnectionError, OSError):
            pass
        finally:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m splitrl.netem.relay", description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="HOST:PORT[,PORT...] to accept connections on")
    parser.add_argument("--to", required=True, help="the server's host (the same ports)")
    parser.add_argument("--delay", required=True, help="added to each direction, e.g. 10ms")
    parser.add_argument("--jitter", default="0ms", help="uniform +- around the delay, order kept, e.g. 2ms")
    args = parser.parse_args(argv)
    host, _, ports = args.listen.rpartition(":")
    try:
        relay = Relay(host, [int(p) for p in ports.split(",")], args.to, parse_time(args.delay, "delay"),
                      parse_time(args.jitter, "jitter"))
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    async def serve() -> None:
        await relay.start()
        print(f"relay ready on {host}:{ports}", flush=True)  # whoever started us waits for this line
        await relay.serve_forever()

    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
