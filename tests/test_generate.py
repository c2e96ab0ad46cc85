"""Generation (scaletorch/models/generate.py): the KV cache changes nothing, sampling filters
do what they say, and greedy tokens equal transformers' for the same checkpoint."""

import math
import os
import tempfile
import unittest

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletorch.models import LlamaConfig, build_model
from scaletorch.models.generate import forward_with_cache, generate, sample_next
from scaletorch.rules import boundary
from tests.test_hf import HAVE_HF, SKIP_REASON, save_transformers_llama

# fp32: the cached path runs the same ops on fewer rows; logits agree to rounding (~1e-7).
ATOL = 1e-5


def tiny(**overrides) -> "torch.nn.Module":
    # init_std 0.2: peaked logits, so a greedy choice is never a rounding-level tie
    kwargs = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_seq_len=64, init_std=0.2)
    kwargs.update(overrides)
    return build_model(LlamaConfig(**kwargs), seed=0)


class TestGenerate(unittest.TestCase):

    def test_kv_cache_gives_the_uncached_logits_and_greedy_tokens(self):
        prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
        for kv_heads, tied in ((2, False), (1, True), (4, False)):
            with self.subTest(kv_heads=kv_heads, tied=tied):
                model = tiny(num_key_value_heads=kv_heads, tie_word_embeddings=tied)
                cached = generate(model, prompt, 30)
                uncached = generate(model, prompt, 30, use_cache=False)
                # Tokens, not floats: the two paths' logits differ by rounding (ATOL below), and
                # a greedy token flips only on a tie that close, which random weights do not make.
                self.assertTrue(torch.equal(cached, uncached))
                self.assertTrue(torch.equal(cached[:, :5], prompt))
                # a prefill of 17 positions then 13 more from the cache = one full forward
                ids = cached[:, :30]
                with torch.no_grad():
                    head, cache = forward_with_cache(model, ids[:, :17], None)
                    tail, cache = forward_with_cache(model, ids[:, 17:], cache)
                    torch.testing.assert_close(torch.cat((head, tail), 1), model(ids), atol=ATOL,
                                               rtol=0)
                self.assertEqual(tuple(cache[0][0].shape), (2, 30, kv_heads, 8))

    def test_top_k_one_and_tiny_top_p_are_greedy(self):
        logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
        greedy = sample_next(logits)
        gen = torch.Generator().manual_seed(0)
        self.assertTrue(torch.equal(sample_next(logits, 1.0, top_k=1, generator=gen), greedy))
        self.assertTrue(torch.equal(sample_next(logits, 1.0, top_p=1e-6, generator=gen), greedy))

    def test_top_k_and_top_p_sample_only_inside_their_set(self):
        # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.8 keeps the first two (0.5 < 0.8 <= 0.8)
        logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(2000, 1)
        gen = torch.Generator().manual_seed(0)
        nucleus = sample_next(logits, 1.0, top_p=0.8, generator=gen)
        self.assertEqual(set(nucleus.tolist()), {0, 1})
        top3 = sample_next(logits, 1.0, top_k=3, generator=gen)
        self.assertEqual(set(top3.tolist()), {0, 1, 2})
        # renormalised: token 0 has 0.5 / 0.8 of the nucleus (2000 draws: std 0.011)
        self.assertAlmostEqual((nucleus == 0).float().mean().item(), 0.625, delta=0.05)
        with self.assertRaises(ValueError):
            sample_next(logits, 1.0, top_p=0.0)

    def test_sampling_is_reproducible_and_stays_below_vocab_size(self):
        model, prompt = tiny(), torch.zeros(1, 1, dtype=torch.long)
        runs = [
            generate(model, prompt, 40, temperature=1.5, top_k=20, top_p=0.95,
                     generator=torch.Generator().manual_seed(7), vocab_size=10) for _ in range(2)
        ]
        self.assertTrue(torch.equal(runs[0], runs[1]))
        self.assertLess(int(runs[0].max()), 10)
        with self.assertRaises(ValueError):
            generate(model, prompt, 64)  # 65 positions > max_seq_len 64


@unittest.skipUnless(HAVE_HF, SKIP_REASON)
class TestGenerateAgainstTransformers(unittest.TestCase):

    def setUp(self):
        # a directory made elsewhere (transformers' save_pretrained, or with our checksums
        # removed), as --trust-unchecked names it
        trust = boundary.trusting([tempfile.gettempdir()])
        trust.__enter__()
        self.addCleanup(trust.__exit__, None, None, None)

    def test_greedy_tokens_equal_transformers_generate(self):
        from scaletorch.models.hf import load_hf_llama
        prompt = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(3))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "hf")
            theirs = save_transformers_llama(path, seed=11, num_attention_heads=4,
                                             num_key_value_heads=2, initializer_range=0.2)
            ours = load_hf_llama(path)
        theirs.generation_config.eos_token_id = None  # 40 tokens, even past an "end" token
        expected = theirs.generate(prompt, max_new_tokens=40, do_sample=False, pad_token_id=0)
        # tokens: equal unless two logits tie within the two models' rounding (see above)
        self.assertTrue(torch.equal(generate(ours, prompt, 40), expected))


def _consolidated(d: str, vocab: int, **model) -> tuple:
    """(a consolidated.pt of a tiny model with its digest, its config.yaml)."""
    import io
    import json

    from scaletorch.rules.safe_files import write_checksummed
    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_seq_len=64)
    buffer = io.BytesIO()
    torch.save({"step": 1, "model": tiny(**shape).state_dict()}, buffer)
    path = os.path.join(d, "consolidated.pt")
    write_checksummed(path, buffer.getvalue())
    config = os.path.join(d, "config.yaml")
    with open(config, "w") as f:
        json.dump({"model": {**shape, **model}}, f)  # JSON is YAML
    return path, config


class GenerateChecksEveryInputBeforeWork(unittest.TestCase):
    """scripts/generate.py with generated bad arguments (sampling settings out of range or
    not finite, a negative token count, a prompt past the model's positions or of no token, a
    seed outside [0, 2**63)) and with a checkpoint of another shape or a tokenizer larger than
    the model's vocabulary: exit 2 and one ``error:`` line, before any token is generated;
    chapter 10 refuses an empty prompt before it trains. In this process; 25 and 20 examples."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.source, cls.config = _consolidated(cls.tmp.name, 256)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def run_generate(self, *args: str) -> tuple:
        import contextlib
        import io

        from scripts import generate as script
        err, out = io.StringIO(), io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            code = script.main([self.source, "--config", self.config, "--tokenizer", "byte", *args])
        return code, err.getvalue(), out.getvalue()

    def assert_refused(self, *args: str) -> str:
        code, err, out = self.run_generate(*args)
        self.assertEqual(code, 2, (args, err))
        self.assertEqual(len(err.splitlines()), 1, err)
        self.assertTrue(err.startswith("error: "), err)
        self.assertEqual(out, "")  # nothing generated
        return err

    def test_good_arguments_generate(self):
        code, err, out = self.run_generate("--prompt", "ab", "--max-new-tokens", "3")
        self.assertEqual((code, err), (0, ""))

    @settings(max_examples=300 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 25,
              deadline=None)
    @given(
        flag=st.sampled_from(
            ["--temperature", "--top-p", "--top-k", "--max-new-tokens",
             "--prompt"]), number=st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                                            st.integers(-10**6, 10**6)), long=st.integers(60, 5000))
    def test_a_bad_argument_is_one_line(self, flag, number, long):
        from scaletorch.models.generate import check_sampling
        if flag == "--prompt":  # with the 60 new tokens by default: past 64 positions
            err = self.assert_refused("--prompt", "x" * long)
            self.assertIn("--prompt", err)
            return
        if flag in ("--top-k", "--max-new-tokens"):
            number = int(number) if math.isfinite(number) else -1
            if number >= 0:
                number = -1 - number
        value = {
            "--temperature": (number, 0, 1.0),
            "--top-p": (0.0, 0, number),
            "--top-k": (0.0, number, 1.0),
            "--max-new-tokens": (0.0, 0, 1.0)
        }[flag]
        try:
            check_sampling(*value)
            if flag != "--max-new-tokens":
                return  # a value in range: not a bad argument
        except ValueError:
            pass
        self.assert_refused(f"{flag}={number}")

    @settings(max_examples=300 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 20,
              deadline=None)
    @given(seed=st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63)),
           prompt=st.sampled_from(["", "ab"]))
    def test_a_seed_out_of_range_or_an_empty_prompt_is_one_line(self, seed, prompt):
        if prompt == "":  # nothing to continue: refused with the other inputs, not in forward
            err = self.assert_refused("--prompt", prompt, "--max-new-tokens", "3")
            self.assertIn("encodes to 0 tokens", err)
            return
        err = self.assert_refused("--seed", str(seed), "--temperature", "1")
        self.assertIn("need a seed in [0, 9223372036854775808)", err)

    def test_the_largest_seed_generates(self):
        code, err, out = self.run_generate("--seed", str(2**63 - 1), "--temperature", "1",
                                           "--prompt", "ab", "--max-new-tokens", "2")
        self.assertEqual((code, err), (0, ""))

    def test_chapter_10_refuses_an_empty_prompt_before_it_trains(self):
        from tests.test_bad_inputs import run_in_process
        code, out = run_in_process("examples/10_real_model.py",
                                   ["--training.steps", "2", "--prompt", ""])
        self.assertEqual(code, 2, out)
        self.assertEqual(
            out, "error: --prompt '': the prompt encodes to 0 tokens: generation "
            "continues a prompt of at least one token\n")

    def test_another_shape_and_a_larger_tokenizer_are_one_line(self):
        with tempfile.TemporaryDirectory() as d:
            _, other = _consolidated(d, 256, hidden_size=64)  # the config of another model
            self.config, saved = other, self.config
            try:
                self.assertIn("holds another model", self.assert_refused())
            finally:
                self.config = saved
            self.source, saved = _consolidated(d, 64)[0], self.source  # vocabulary 64 < 256
            self.config, saved_config = os.path.join(d, "config.yaml"), self.config
            try:
                self.assertIn("has 256 tokens, the model 64", self.assert_refused())
            finally:
                self.source, self.config = saved, saved_config
