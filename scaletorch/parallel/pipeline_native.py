"""PyTorch's own pipeline beside ours: torch.distributed.pipelining over the same chunks."""

from typing import List, Union

import torch
from torch.distributed import pipelining

from scaletorch.data import local_batch
from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.dist.comm import average_over_group
from scaletorch.models import MoE, loss_fn
from scaletorch.parallel.pipeline_parallel import LossFn, PipelineModel

MULTI_STAGE = {  # torch's schedules that drive several chunks per rank
    "interleaved": pipelining.ScheduleInterleaved1F1B,
    "zb-h1": pipelining.ScheduleInterleavedZeroBubble,  # ZB-H1 with one stage per rank
    "zbv": pipelining.ScheduleZBVZeroBubble,
    "dualpipev": pipelining.ScheduleDualPipeV,
}


class TorchPipelineSchedule:
    """``PipelineSchedule``'s contract with torch.distributed.pipelining (the native reference):
    ScheduleGPipe, Schedule1F1B, or ``MULTI_STAGE``'s schedule over this rank's chunks. Its
    messages bypass our ledger. Gradients are scaled by 1/m (scale_grads) as ours."""

    def __init__(self, pipe: PipelineModel, pgm: ProcessGroupManager, schedule: str,
                 num_micro_batches: int, loss_fn: LossFn = loss_fn) -> None:
        if any(isinstance(m, MoE) for m in pipe.modules()):
            raise ValueError("torch.distributed.pipelining runs dense models only here (it "
                             "would drop the MoE load-balancing losses); use impl ours")
        if any(getattr(p, "shared_embedding", False) for p in pipe.parameters()):
            raise ValueError("tie_word_embeddings true with torch.distributed.pipelining: its "
                             "stages do not share parameters across ranks (no embedding group "
                             "sums the first and the last stage's copies); use impl ours")
        self.pipe, self.pgm, self.m = pipe, pgm, num_micro_batches
        device = next(pipe.parameters()).device
        stages = [
            pipelining.PipelineStage(chunk, s, pipe.num_stages, device,
                                     group=pgm.pipeline_model_parallel_group)
            for chunk, s in zip(pipe.chunks, pipe.stages)
        ]
        self.schedule: Union[pipelining.schedules.PipelineScheduleMulti,
                             pipelining.schedules.PipelineScheduleSingle]
        if schedule in MULTI_STAGE:
            # torch types the stages list[_PipelineStageBase], its private base (list is invariant)
            runtime = MULTI_STAGE[schedule]
            self.schedule = runtime(stages, self.m, loss_fn=loss_fn)  # type: ignore[arg-type]
        else:
            cls = pipelining.ScheduleGPipe if schedule == "afab" else pipelining.Schedule1F1B
            self.schedule = cls(stages[0], num_micro_batches, loss_fn=loss_fn)

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pgm, pipe = self.pgm, self.pipe
        inputs, targets, _ = local_batch(inputs, targets, pgm.data_parallel_rank,
                                         pgm.data_parallel_world_size)
        last = pipe.num_stages - 1 in pipe.stages
        losses: List[torch.Tensor] = []
        args = (inputs, ) if 0 in pipe.stages else ()
        self.schedule.step(*args, target=targets if last else None, losses=losses if last else None)
        zero = torch.zeros((), device=inputs.device)
        loss = torch.stack(losses).mean().detach() if last else zero
        comm.all_reduce(loss, pgm.pipeline_model_parallel_group)
        return average_over_group(loss, pgm.gradient_sync_group)
