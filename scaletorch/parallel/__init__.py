"""The strategies, one core per chapter, each converting the reference model in place.

Chapter 01 data_parallel (+ step, grad_norm, memory_report), 02 zero (+ flat_unit,
zero_report, fully_shard), 03 tensor_parallel (+ tensor_parallel_layers,
tensor_parallel_dtensor), 04 pipeline_parallel, 05 context_parallel (+ ring_attention),
06 expert_parallel; chapter 07's parallelize composes them all. doc/design.md maps every
module.
"""
