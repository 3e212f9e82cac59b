"""Benchmarks and the lab: measure the parts of splitrl that decide how fast the link is, and report on runs.

`transport_bench`, `e2e_bench`, `codec_bench`, `learning_bench`, `swap_bench` and
`lab_bench` are the ``splitrl bench ...`` benchmarks; `lab` runs both stages in the
two-namespace lab (``splitrl lab``) with `throughput_probe` at both ends of its
throughput measurement; `report` draws figures and tables from run directories
(``splitrl report``, ``splitrl curve``).
"""
