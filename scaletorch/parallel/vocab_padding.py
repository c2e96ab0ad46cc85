"""Chapter 10: a vocabulary that tensor parallel does not divide, padded as Megatron pads it.

Chapter 03 splits the embedding and the head into equal vocabulary shards over "tp". Real
vocabularies do not always divide: 32000 at tp 3, GPT-2's 50257 at tp 2. Here both tables get
zero rows appended, up to a multiple of ``model.vocab_pad_to`` x tp (rules/vocab.py: 50257 at
tp 2 -> 50432), before chapter 03's ``apply_tensor_parallel`` splits them. No token id reaches
a padding row of the embedding. The head becomes ``PaddedVocabHead``, whose padding columns get
a logit of -inf: exp(-inf) = 0, so they carry no probability, no gradient, and are never
sampled. Each padded weight carries ``vocab_padding = (V, V_padded)``; gathering a state
(``--check``, checkpoints, the export) cuts those rows. A vocabulary tp divides is left alone.

    parallelize(model, cfg, pgm, device, tensor_parallel=apply_tensor_parallel_padded)
"""

from typing import Any

import torch
from torch import nn

from scaletorch.dist import ProcessGroupManager, comm
from scaletorch.models import Llama
from scaletorch.parallel.tensor_parallel import apply_tensor_parallel
from scaletorch.parallel.tensor_parallel_layers import ColumnParallelLinear, FullSequence, Logits
from scaletorch.rules.vocab import padded_vocab_size


def _with_zero_rows(weight: torch.Tensor, rows: int) -> nn.Parameter:
    """weight (V, h) with zero rows appended up to (rows, h): rows no token id reaches."""
    zeros = weight.new_zeros(rows - weight.size(0), weight.size(1))
    return nn.Parameter(torch.cat((weight.detach(), zeros)))


# [core: padded-head]
class PaddedVocabHead(ColumnParallelLinear):
    """Chapter 03's vocabulary-parallel head whose padding columns give -inf logits.

    x (b, s, h) -> logits (b, s, V_padded/tp); columns of rows >= ``vocab_size`` are -inf.
    """

    vocab_size: int = 0  # the real vocabulary
    vocab_start: int = 0  # this rank's first row

    def forward(self, x: FullSequence) -> Logits:
        logits = super().forward(x)  # (b, s, V_padded/tp)
        first = self.vocab_size - self.vocab_start  # local columns from here are padding
        if first < logits.size(-1):
            beyond = torch.arange(logits.size(-1), device=logits.device) >= first
            logits = logits.masked_fill(beyond, float("-inf"))
        return logits


# [end: padded-head]
def apply_tensor_parallel_padded(model: Llama, pgm: ProcessGroupManager,
                                 sequence_parallel: bool = False, **plan: Any) -> Llama:
    """Chapter 03's ``apply_tensor_parallel`` (``plan``: its argument), after padding the
    vocabulary to a multiple of ``model.vocab_pad_to`` x tp when tp does not divide it; the
    head masks the padding."""
    cfg, tp = model.config, pgm.tensor_model_parallel_world_size
    rows = padded_vocab_size(cfg.vocab_size, tp, cfg.vocab_pad_to)
    if rows == cfg.vocab_size:
        return apply_tensor_parallel(model, pgm, sequence_parallel, **plan)
    ref: Any = model  # the reference's types say nn.Embedding and nn.Linear
    ref.embed_tokens.weight = _with_zero_rows(ref.embed_tokens.weight, rows)
    ref.embed_tokens.num_embeddings = rows
    ref.lm_head.weight = _with_zero_rows(ref.lm_head.weight, rows)  # untied here, tied again
    ref.lm_head.out_features = rows  # by parallelize after the split
    apply_tensor_parallel(model, pgm, sequence_parallel, **plan)
    head = ref.lm_head
    head.__class__ = PaddedVocabHead  # the class swap of mixed_precision.py: state stays
    head.vocab_size = cfg.vocab_size
    head.vocab_start = comm.group_rank(pgm.tensor_model_parallel_group) * head.weight.shape[0]
    for weight in (ref.embed_tokens.weight, head.weight):  # one tensor when tied
        setattr(weight, "vocab_padding", (cfg.vocab_size, rows))
    return model
