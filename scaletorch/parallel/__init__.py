"""The strategies, one core per chapter, each converting the reference model in place.

Chapter 01 data_parallel (+ gradient_sync, grad_norm, memory_report, wrapper), 02 zero
(+ flat_unit, zero_report, fully_shard), 03 tensor_parallel (+ tensor_parallel_layers,
tensor_parallel_dtensor), 04 pipeline_parallel (+ pipeline_native), 04b pipeline_runtime
(+ activation_meter), 05 context_parallel (+ ring_attention, attention_kernels, step),
06 expert_parallel; chapter 07's parallelize (+ tensor_layout, native, zero_chunks) composes
them all; 08 mixed_precision (+ loss_scale) and 10 tied_embeddings, zero_tied,
activation_checkpointing attach to it. Chapter 12's sync_batchnorm and vision_parallel put a
ResNet under 01's and 02's wrappers. tests/test_reading_path.py checks this map;
doc/design.md explains it.
"""
