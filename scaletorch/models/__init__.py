"""Models: a small Llama and a ResNet (chapter 12), both knowing nothing about parallelism."""

from scaletorch.models.llama import (MLP, Attention, Llama, LlamaConfig, RMSNorm, TransformerBlock,
                                     apply_rope, build_model, causal_attention, loss_fn,
                                     rope_cos_sin)
from scaletorch.models.moe import Experts, MoE, moe_aux_loss
from scaletorch.models.resnet import (BasicBlock, ResNet, ResNetConfig, build_resnet,
                                      classification_loss, tiny_resnet_config)

__all__ = [
    "Attention",
    "Llama",
    "LlamaConfig",
    "MLP",
    "RMSNorm",
    "TransformerBlock",
    "apply_rope",
    "build_model",
    "causal_attention",
    "Experts",
    "MoE",
    "moe_aux_loss",
    "loss_fn",
    "rope_cos_sin",
    "BasicBlock",
    "ResNet",
    "ResNetConfig",
    "build_resnet",
    "classification_loss",
    "tiny_resnet_config",
]
