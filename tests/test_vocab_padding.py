"""A vocabulary that tensor parallel does not divide is padded (Megatron's make-vocab-size-
divisible-by, ``model.vocab_pad_to``) by chapter 10's ``apply_tensor_parallel_padded``
(vocab_padding.py), and the run still equals the unpadded single-device one.

World 3: vocabulary 1000 at tp 3 (1000 % 3 = 1, padded to 1152). World 4: vocabulary 1001
(odd) at tp 2 x pp 2 and tp 2 x dp 2 with ZeRO-3, padded to 1024, and GPT-2's 50257 at tp 2 x
dp 2, padded to 50432 (hidden 32, so its 1.6M-row tables stay cheap). Each compares losses, grad
norms and the gathered full weights (which have the reference's unpadded shapes) with a single
device run at 1e-5 (tests/layouts.py), over 3 steps: past the 2 warm-up steps, and a wrong
padding or shard shows from step 1 on.
"""

import json
import os
import tempfile
import unittest

import numpy as np
import torch

from scaletorch.data.tokenizer import META_FORMAT, meta_path
from scaletorch.dist import destroy_pg_manager
from scaletorch.models import build_model
from scaletorch.parallel.parallelize import parallelize
from scaletorch.parallel.vocab_padding import apply_tensor_parallel_padded
from scaletorch.rules.safe_files import checksum_path, write_checksum, write_checksummed
from scaletorch.rules.vocab import padded_vocab_size
from scaletorch.trainer.param_map import param_map
from tests.harness import run_distributed
from tests.layouts import (assert_parity, layout, make_config, pg_manager_for, reference_key,
                           references, train)

STEPS = 3
WORLD3 = {"vocab1000_tp3": (1000, layout(tp=3))}
WORLD4 = {
    "vocab1001_tp2_pp2": (1001, layout(tp=2, pp=2)),
    "vocab1001_tp2_dp2_zero3": (1001, layout(tp=2, zero_stage=3)),
    "vocab50257_tp2_dp2": (50257, layout(tp=2)),
}


def gpt2_sized_tokens() -> str:
    """A .bin of 4096 seeded random uint16 ids below 50257: the synthetic chain cannot hold a
    50257 x 50257 matrix. Same bytes in every process, so writing it twice is harmless."""
    path = os.path.join(tempfile.gettempdir(), "scaletorch_test_vocab50257.bin")
    if not os.path.isfile(path):
        tokens = np.random.default_rng(0).integers(0, 50257, size=4096, dtype=np.uint16)
        partial = f"{path}.{os.getpid()}"
        tokens.tofile(partial)
        os.replace(partial, path)
    if not os.path.isfile(checksum_path(path)):  # as scripts/prepare_text.py writes it
        write_checksum(path)
    if not os.path.isfile(meta_path(path)):  # its record too (dtype, vocabulary)
        write_checksummed(
            meta_path(path),
            json.dumps({
                "format": META_FORMAT,
                "dtype": "uint16",
                "tokens": 4096,
                "vocab_size": 50257,
                "tokenizer": "gpt2"
            }).encode())
    return path


def config(vocab: int, parallel: dict):
    cfg = make_config(**parallel)
    cfg.model.vocab_size, cfg.training.steps = vocab, STEPS
    if vocab > 4096:
        cfg.data.dataset, cfg.data.path = "bin", gpt2_sized_tokens()
    if parallel["tensor_model_parallel_size"] == 3:  # heads, kv heads and FFN divisible by 3
        m = cfg.model
        m.hidden_size, m.num_attention_heads, m.num_key_value_heads = 48, 6, 3
        m.intermediate_size = 96
        # lr 1e-3, not 3e-3: AdamW turns rounding-level gradient differences of near-0
        # elements into weight differences that grow with lr; at 3e-3 one up_proj element
        # drifted 1.04e-5 on an AMD EPYC (passed elsewhere), 3.5e-6 at 1e-3
        cfg.training.lr = 1e-3
    return cfg


def padded_head_logits(vocab: int, parallel: dict) -> dict:
    """Inside a world: this rank's head logits on a few tokens, its padding columns, and
    whether scattering the unpadded full weights (a resume at this layout) gives its shards."""
    cfg = config(vocab, parallel)
    pgm = pg_manager_for(cfg)
    model = build_model(cfg.model, seed=0)
    par = parallelize(model, cfg, pgm, torch.device("cpu"),
                      tensor_parallel=apply_tensor_parallel_padded)
    head = model.lm_head
    logits = head(torch.randn(1, 4, cfg.model.hidden_size))  # (1, 4, V_padded / tp)
    local = param_map(par).scatter(build_model(cfg.model, seed=0).state_dict())
    destroy_pg_manager()
    return {
        "cols": logits.size(-1),
        "start": head.vocab_start,
        "inf": torch.isinf(logits).all(dim=(0, 1)).tolist(),
        "scatter_exact": all(torch.equal(p.detach(), t) for p, t in local.items())  # copies
    }


def _world(rank: int, world_size: int, layouts: dict) -> dict:
    out = {name: train(config(vocab, parallel)) for name, (vocab, parallel) in layouts.items()}
    vocab, parallel = next(iter(layouts.values()))
    out["head"] = padded_head_logits(vocab, parallel)
    return out


class TestPaddedVocabularyMatchesSingleDevice(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.results = {}
        for layouts, world in ((WORLD3, 3), (WORLD4, 4)):
            ranks = run_distributed(_world, world, layouts, timeout=300)
            configs = {name: config(*spec) for name, spec in layouts.items()}
            refs = references(configs.values())
            cls.results.update({
                name: (ranks, refs[reference_key(cfg)])
                for name, cfg in configs.items()
            })
            cls.results[f"head{world}"] = ranks

    def test_padded_size_follows_megatron_and_only_when_tp_does_not_divide(self):
        self.assertEqual(padded_vocab_size(1000, 3, 128), 1152)
        self.assertEqual(padded_vocab_size(50257, 2, 128), 50432)
        self.assertEqual(padded_vocab_size(32000, 2, 128), 32000)  # divides: left alone
        self.assertEqual(padded_vocab_size(64, 4, 128), 64)

    def test_losses_grad_norms_and_unpadded_weights_equal_the_single_device_run(self):
        for name in list(WORLD3) + list(WORLD4):
            with self.subTest(layout=name):
                ranks, reference = self.results[name]
                assert_parity(self, ranks, name, reference)
                state = ranks[0][name]["state"]
                self.assertEqual(tuple(state["embed_tokens.weight"].shape[:1]),
                                 (WORLD3.get(name, WORLD4.get(name))[0], ))

    def test_padding_columns_of_the_head_are_minus_infinity_and_only_those(self):
        for world, vocab in ((3, 1000), (4, 1001)):
            for rank, res in enumerate(self.results[f"head{world}"]):
                head = res["head"]
                real = max(0, min(head["cols"], vocab - head["start"]))
                with self.subTest(world=world, rank=rank):
                    self.assertEqual(head["inf"], [False] * real + [True] * (head["cols"] - real))
                    # unpadded full weights scatter to this rank's padded shards exactly
                    self.assertTrue(head["scatter_exact"])
