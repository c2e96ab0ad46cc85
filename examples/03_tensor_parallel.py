"""Chapter 03: tensor parallel. Every matrix of every block is split over the "tp" ranks.

    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 2 -- --check
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 4 -- --tp 4 \
        --model.num_key_value_heads 4 --check     # tp 4 needs 4 kv heads: a different model
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 4 -- --sequence-parallel
    scripts/launch.sh examples/03_tensor_parallel.py --nproc-per-node 2 -- --impl torch --check

With 4 processes and the config's tp 2, the other factor 2 is data parallel (tp 2 x dp 2).
The model is chapter 00's (4 query, 2 key/value heads): tp 2 splits both evenly; tp 4 needs
4 key/value heads, a different model (the layout check says so before anything starts).

The new lines: ``apply_tensor_parallel`` converts the model (column / row / vocab-parallel
layers); the step takes the vocab-parallel loss and the clip counts every shard once. With
dp > 1 chapter 01's data-parallel wrapper goes around the tensor-parallel model. ``--impl
torch`` runs torch's DTensor tensor parallel (``parallelize_module``) on the same model
instead, with FSDP2's ``replicate`` over dp.
"""

import math
import sys
from contextlib import nullcontext

import torch
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.tensor.parallel import loss_parallel

from scaletorch.data import local_batch, split_micro_batches
from scaletorch.dist import (comm, destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager_from_config)
from scaletorch.dist.full_state import gather_tensor_parallel_state_dict
from scaletorch.models import build_model
from scaletorch.parallel.data_parallel import apply_data_parallel
from scaletorch.parallel.fully_shard import shard_blocks_then_root
from scaletorch.parallel.tensor_parallel import (apply_tensor_parallel,
                                                 tensor_parallel_clip_grad_norm,
                                                 tensor_parallel_loss_fn, tp_report)
from scaletorch.parallel.tensor_parallel_dtensor import (apply_dtensor_tensor_parallel, device_mesh,
                                                         dtensor_loss_fn, native_clip_grad_norm)
from scaletorch.trainer import build_optimizer, check_against_reference, load_config, start_run
from scaletorch.trainer.precision import activation_element_size, autocast


def limits(cfg, world_size: int) -> None:
    """This chapter's scope (load_config checks it with the layout, before anything starts)."""
    p = cfg.parallel
    later = {
        "pp": p.pipeline_model_parallel_size > 1,
        "cp": p.context_parallel_size > 1,
        "ep": p.expert_model_parallel_size > 1,
        "zero_stage": p.zero_stage > 0,
        "num_experts": cfg.model.num_experts > 0,
        "activation_checkpointing": p.activation_checkpointing != "none",
        "reduce_dtype": p.reduce_dtype != "fp32",
        "tie_word_embeddings": cfg.model.tie_word_embeddings,
        f"--impl {p.impl}": p.impl not in ("ours", "torch"),
        "tp 1": p.tensor_model_parallel_size == 1
    }
    if any(later.values()):
        raise ValueError(f"03_tensor_parallel is tp > 1 beside plain data parallel, impl "
                         f"ours or torch; {', '.join(k for k, v in later.items() if v)}: "
                         f"run chapter 07 (10 adds recomputation)")
    vocab, tp = cfg.model.vocab_size, p.tensor_model_parallel_size
    if vocab % tp != 0:  # the vocabulary splits evenly here; chapter 10 pads one that does not
        raise ValueError(f"model.vocab_size ({vocab}) is not divisible by "
                         f"tensor_model_parallel_size ({tp}): chapter 03 splits the vocabulary "
                         f"evenly; examples/10_real_model.py pads it")


def main() -> int:
    cfg = load_config("examples/configs/03_tensor_parallel.yaml",
                      "Chapter 03: tensor parallel (+ sequence parallel)", limits)
    env = init_distributed(cfg.training.timeout_seconds)
    p = cfg.parallel
    pgm = init_pg_manager_from_config(p, cfg.training.timeout_seconds)
    pgm.log_topology()
    dp = pgm.data_parallel_world_size

    model = build_model(cfg.model, seed=cfg.training.model_seed).to(env.device)
    if p.impl == "torch":  # PyTorch's own: DTensor tp, FSDP2's replicate over dp
        mesh = device_mesh(pgm, env.device.type)
        tp_model = apply_dtensor_tensor_parallel(model, mesh["tp"], p.sequence_parallel)
        if dp > 1:  # FSDP2's replicate over dp: each block, then the root (chapter 02's units)
            shard_blocks_then_root([model], mesh["dp"], replicate)
        loss_fn, clip = dtensor_loss_fn, native_clip_grad_norm(list(model.parameters()), pgm)
    else:  # the new idea: tp shards every block
        tp_model = apply_tensor_parallel(model, pgm, p.sequence_parallel)
        if dp > 1:  # chapter 01 around it
            model = apply_data_parallel(tp_model, pgm, p.impl, p.bucket_size_mb)
        loss_fn, clip = tensor_parallel_loss_fn(pgm), tensor_parallel_clip_grad_norm(tp_model, pgm)
    if not hasattr(model, "finish_grad_sync"):  # dp 1, or DTensor's replicate: syncs in backward
        model.no_sync, model.finish_grad_sync = nullcontext, lambda: None
    optimizer = build_optimizer(cfg, model.parameters())  # AdamW, on this rank's shards
    m, max_norm = cfg.data.num_micro_batches, cfg.training.grad_clip or math.inf  # 0: no clip

    # [core: step]
    with start_run(cfg, model, optimizer, pgm) as run:  # run directory, resume, checkpoints
        for inputs, targets in run.batches():  # this step's batch (b, s): inputs and next tokens
            optimizer.zero_grad(set_to_none=True)
            # the tp ranks of a dp rank take the same sequences: each computes its own shards
            inputs, targets, _ = local_batch(inputs, targets, pgm.data_parallel_rank, dp)
            loss = torch.zeros((), device=env.device)
            with autocast(cfg, env.device), \
                    loss_parallel() if p.impl == "torch" else nullcontext():  # DTensor's loss
                for i, (x, y) in enumerate(split_micro_batches(inputs, targets, m)):
                    with nullcontext() if i == m - 1 else model.no_sync():  # chapter 01's sync
                        # the new line: the vocab-parallel loss of this rank's logits (b, s, V/tp)
                        micro_loss = loss_fn(model(x), y) / m  # f and g all-reduce over tp
                        micro_loss.backward()
                    loss += micro_loss.detach()
            model.finish_grad_sync()
            loss = comm.average_over_group(loss, pgm.gradient_sync_group)  # the global mean
            grad_norm = clip(max_norm)  # every shard's squares once, summed over tp
            run.record(loss, grad_norm)  # logged; a NaN or inf stops the run here
            optimizer.step()
    # [end: step]
    result = run.result

    # What this chapter is about: 2 + 2 collectives of b x s x h per block, nothing bigger.
    element_size = activation_element_size(cfg, env.device.type)  # 2 bytes in bf16 (chapter 08)
    report = tp_report(cfg, pgm, cfg.training.steps - 1, element_size)
    if pgm.rank == 0:
        print(report)

    ok = True
    if cfg.check:
        full = gather_tensor_parallel_state_dict(tp_model, pgm)  # collective over tp, on rank 0
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step,
                                     grad_norms=result.grad_norms)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
