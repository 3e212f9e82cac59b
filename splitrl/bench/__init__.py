"""Benchmarks: measure the parts of splitrl that decide how fast the link is, and what a hostile peer can do.

Each is a ``splitrl bench ...`` command: `transport_bench`, `e2e_bench`,
`codec_bench`, `learning_bench`, `pipeline_bench`, `vector_bench`, `fleet_bench`,
`capacity_bench`, `plan_bench`, `swap_bench` and `lab_bench` (in the two-namespace
lab, `splitrl.lab`); `fuzz` and `reliability` feed the decoder and a live stage1
mutated frames and measure what a hostile or dead peer costs. The lab itself
(``splitrl lab``) is `splitrl.lab` and the figures and tables of run directories
(``splitrl report``, ``splitrl curve``) are `splitrl.report`; probes that answered
one question live outside the package, in benchmarks/.
"""
