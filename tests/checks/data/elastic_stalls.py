"""A trainer declared elastic whose rank 1 never comes back from its resume: what a resized group that hangs leaves
(tests/checks/test_elastic_resume.py)."""

import time

import torch.distributed as dist

from ddp_conformance.adapter import TrainerAdapter


class Trainer(TrainerAdapter):
    elastic = True

    def resume(self, checkpoint, steps, *, observer=None):
        if dist.get_rank() == 1:
            time.sleep(600)
        dist.barrier()
