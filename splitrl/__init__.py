"""splitrl: PPO split across a slow link, stage0 (envs and the layers before the cut) and stage1 (the rest and
the learner) as separate processes, with every byte on the link counted.

The layers, top to bottom (each imports only those below it; tests/test_layers.py keeps it so):

- `cli` (click commands only), then `bench` (benchmarks), `lab` (the shaped-link lab), `report` (figures and
  tables from run directories) and `plan` (seconds per iteration and the cut from measured runs);
- `runner`: the thin workers around a schedule (run directory and resume, links, joining, a stage as a
  process, the in-process twin);
- `schedule`: when things happen (synchronous, pipelined, asynchronous, a fleet's loops);
- `stages`: what each side computes, with no link (`Edge` for stage0, `Learner` for stage1, the training
  exchanges);
- `settings`, `models` (the network as named layers, cut anywhere its output is flat), `envs` (and `pick_by_cue`,
  a tiny env of Dict observations it registers, `carracing`, CarRacing's road and score drawn for less CPU, and
  `grayscale`, gymnasium's grayscale frames for less CPU);
- `codecs`, `ppo`, `transport`, `netem`;
- `runs`, `checkpoints` (data only, read without running code), `launch`, `errors`, `units`, `devices` (where a
  stage computes, and the crossings between the wire's host memory and that device), `lazy` (a package's names
  loaded on first use).

Names: stage0 and stage1 are the two roles (commands, the wire's roles, the files a run writes); the edge and
the server are the machines they run on.
"""
