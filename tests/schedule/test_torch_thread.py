"""`torch_thread`: a thread that does torch work runs on the process's ``--threads``, as the main thread does."""

import pytest
import torch

from splitrl.schedule.common import torch_thread


def _product_on(make_thread, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = {}

    def work() -> None:
        out["product"] = a @ b

    thread = make_thread(work)
    thread.start()
    thread.join(timeout=60)
    return out["product"]


def test_a_torch_thread_computes_what_the_main_thread_computes_on_its_threads():
    """The twin's stage1 and the asynchronous schedules' rollouts run on such threads: on a new thread after
    ``set_num_threads(1)``, this product came out with the two-thread numbers on the 2-core CI machine."""
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 4096, generator=g), torch.randn(4096, 32, generator=g)
    try:
        torch.set_num_threads(2)
        two = a @ b
        torch.set_num_threads(1)
        one = a @ b
        if torch.equal(one, two):
            pytest.skip("this machine's product gives the same numbers on one thread and two: nothing to tell apart")
        assert torch.equal(_product_on(lambda work: torch_thread(work, "test"), a, b), one)
    finally:
        torch.set_num_threads(threads)
