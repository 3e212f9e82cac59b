"""Probes that answer one question about splitrl, outside the package: plain scripts, each run as

    python benchmarks/NAME.py [OPTIONS]

with splitrl importable (installed, or ``PYTHONPATH=.`` from the repository's root).

- `floor_rtt`: where a 16 KiB round trip's time goes between raw pyzmq and a transport that hands over tensors.
- `rtt_breakdown`: one transport round trip taken apart (encode, send, wait, decode, the peer's turnaround).
- `carracing_road`: CarRacing's env step as gymnasium draws it, with `splitrl.carracing`'s road pass alone, and
  with its road pass and kept font, side by side (the frames compared, each one's CPU a step).
- `grayscale`: gymnasium's grayscale of a CarRacing frame against `splitrl.grayscale`'s (the bytes compared).
- `learners_bench`: the learners' all-reduce, timed in real gloo processes.
- `async_probe`: the twin with its Edge and Learner watched, checking that what the asynchronous schedule
  trains on is what its envs and acting policies produced (run by tests/schedule/test_async_alignment.py);
  its parts are the package `alignment` (the record, the checks, the hooks on each stage, the plants).

The benchmarks with a ``splitrl bench ...`` command live in `splitrl.bench`.
"""
