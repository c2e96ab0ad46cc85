"""Hugging Face Llama checkpoints in and out (scaletorch/models/hf.py), against transformers.

Needs the ``hf`` extra (safetensors, transformers); without it the tests skip and say so.
"""

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import unittest

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from scaletorch.rules import boundary
from tests.harness import bit_exact

HAVE_HF = all(importlib.util.find_spec(m) for m in ("safetensors", "transformers"))
SKIP_REASON = 'needs the hf extra: pip install -e ".[hf]" (safetensors, transformers)'
if not HAVE_HF:
    print(f"tests/test_hf.py: skipped, {SKIP_REASON}", file=sys.stderr)

# fp32 on CPU: the same maths in a different order (SDPA vs our matmul) agree to ~1e-7.
ATOL = 1e-5

# GQA / MHA / MQA, tied and untied, theta 1e4 and 5e5.
CONFIGS = [
    dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e4),
    dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False, rope_theta=5e5),
    dict(num_attention_heads=8, num_key_value_heads=1, tie_word_embeddings=False, rope_theta=1e4),
]


def save_transformers_llama(path: str, seed: int, **overrides) -> "object":
    """A tiny random LlamaForCausalLM (norms random too, so a swapped norm shows) saved to path."""
    import transformers
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    kwargs = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  max_position_embeddings=64, rms_norm_eps=1e-5)
    kwargs.update(overrides)
    max_shard_size = kwargs.pop("max_shard_size", None)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
    extra = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **extra)
    return model


def read_safetensors(path: str) -> dict:
    """{name: tensor} over every safetensors file of a directory."""
    from safetensors.torch import load_file
    out = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, file)))
    return out


@unittest.skipUnless(HAVE_HF, SKIP_REASON)
class TestHuggingFaceLlamaRoundTrip(unittest.TestCase):

    def setUp(self):
        # a directory made elsewhere (transformers' save_pretrained, or with our checksums
        # removed), as --trust-unchecked names it
        trust = boundary.trusting([tempfile.gettempdir()])
        trust.__enter__()
        self.addCleanup(trust.__exit__, None, None, None)

    @bit_exact  # the export's tensors are the import's, copied
    def test_transformers_llama_loads_with_equal_logits_and_exports_back(self):
        import transformers

        from scaletorch.models.hf import export_hf_llama, load_hf_llama
        tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
        for i, overrides in enumerate(CONFIGS):
            with self.subTest(**overrides), tempfile.TemporaryDirectory() as tmp:
                hf_dir, out_dir = os.path.join(tmp, "hf"), os.path.join(tmp, "ours")
                theirs = save_transformers_llama(hf_dir, seed=i, **overrides)
                ours = load_hf_llama(hf_dir)
                self.assertEqual(ours.lm_head.weight is ours.embed_tokens.weight,
                                 overrides["tie_word_embeddings"])
                with torch.no_grad():
                    expected = theirs(tokens).logits
                    torch.testing.assert_close(ours(tokens), expected, atol=ATOL, rtol=0)
                export_hf_llama(ours, out_dir)
                # import then export is the identity on the stored tensors, bit for bit
                before, after = read_safetensors(hf_dir), read_safetensors(out_dir)
                self.assertEqual(sorted(before), sorted(after))
                for name in before:
                    self.assertTrue(torch.equal(before[name], after[name]), name)
                back = transformers.LlamaForCausalLM.from_pretrained(out_dir).eval()
                with torch.no_grad():
                    torch.testing.assert_close(back(tokens).logits, expected, atol=ATOL, rtol=0)

    def test_sharded_checkpoints_load_both_ways(self):
        import transformers

        from scaletorch.models.hf import INDEX_FILE, export_hf_llama, load_hf_llama
        tokens = torch.arange(20).view(1, 20)
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir, out_dir = os.path.join(tmp, "hf"), os.path.join(tmp, "ours")
            theirs = save_transformers_llama(hf_dir, seed=5, max_shard_size="20KB", **CONFIGS[1])
            self.assertTrue(os.path.isfile(os.path.join(hf_dir, INDEX_FILE)))
            ours = load_hf_llama(hf_dir)
            with torch.no_grad():
                expected = theirs(tokens).logits
                torch.testing.assert_close(ours(tokens), expected, atol=ATOL, rtol=0)
            files = export_hf_llama(ours, out_dir, max_shard_bytes=20_000)
            self.assertGreater(sum(f.endswith(".safetensors") for f in files), 2)
            back = transformers.LlamaForCausalLM.from_pretrained(out_dir).eval()
            with torch.no_grad():
                torch.testing.assert_close(back(tokens).logits, expected, atol=ATOL, rtol=0)

    @bit_exact
    def test_bfloat16_export_round_trips_bit_for_bit(self):
        from scaletorch.models.hf import export_hf_llama, load_hf_llama
        with tempfile.TemporaryDirectory() as tmp:
            save_transformers_llama(os.path.join(tmp, "hf"), seed=3, **CONFIGS[0])
            export_hf_llama(load_hf_llama(os.path.join(tmp, "hf")), os.path.join(tmp, "bf16"),
                            dtype=torch.bfloat16)
            # bf16 -> fp32 (our training copy) -> bf16 is exact
            export_hf_llama(load_hf_llama(os.path.join(tmp, "bf16")), os.path.join(tmp, "again"),
                            dtype=torch.bfloat16)
            first, second = (read_safetensors(os.path.join(tmp, d)) for d in ("bf16", "again"))
            for name, tensor in first.items():
                self.assertEqual(tensor.dtype, torch.bfloat16)
                self.assertTrue(torch.equal(tensor, second[name]), name)


@unittest.skipUnless(HAVE_HF, SKIP_REASON)
class AnExportHasAChecksumPerFileAndAFlippedByteIsRefusedNamingIt(unittest.TestCase):
    """export_hf_llama writes each file with its sha256, as every checkpoint file; loading an
    export of ours verifies each file before it parses it."""

    def assert_same_weights(self, model, reference) -> None:
        mine, theirs = model.state_dict(), reference.state_dict()
        self.assertEqual(list(mine), list(theirs))
        for name in mine:  # a file written and read back: the same bits
            self.assertTrue(torch.equal(mine[name], theirs[name]), name)

    @bit_exact
    def test_every_file_kind_flipped_is_refused_naming_it_and_restored_loads(self):
        from scaletorch.models import LlamaConfig, build_model
        from scaletorch.models.hf import export_hf_llama, load_hf_llama
        from scaletorch.rules.safe_files import CorruptFileError, read_checksum, sha256
        from tests.test_checksums import flip_byte
        model = build_model(LlamaConfig(vocab_size=50, hidden_size=32, num_layers=2), seed=0)
        with tempfile.TemporaryDirectory() as tmp:
            for shard_bytes in (None, 30_000):  # one file; shards with an index
                d = os.path.join(tmp, str(shard_bytes))
                files = export_hf_llama(model, d, max_shard_bytes=shard_bytes)
                names = [os.path.basename(f) for f in files]
                self.assertEqual(sorted(os.listdir(d)),
                                 sorted(names + [n + ".sha256" for n in names]))
                for file in files:
                    with open(file, "rb") as f:
                        self.assertEqual(read_checksum(file), sha256(f.read()))
                for file in files:
                    with self.subTest(shards=shard_bytes, file=os.path.basename(file)):
                        flip_byte(file)
                        with self.assertRaises(CorruptFileError) as ctx:
                            load_hf_llama(d)
                        self.assertEqual(
                            str(ctx.exception), f"{file!r} does not match its checksum in "
                            f"{os.path.basename(file)}.sha256 ({os.path.getsize(file)} bytes; "
                            f"truncated or damaged)")
                        flip_byte(file)  # restored: it loads, the same weights bit for bit
                self.assert_same_weights(load_hf_llama(d), model)
                # without its checksums (as the Hub gives a directory) it is refused, until
                # the user trusts it by name (--trust-unchecked): then it is read as it is
                for file in files:
                    os.remove(file + ".sha256")
                with self.assertRaisesRegex(CorruptFileError, "has no checksum file.*"
                                            "--trust-unchecked"):
                    load_hf_llama(d)
                with boundary.trusting([d]):
                    self.assert_same_weights(load_hf_llama(d), model)


ROPE_TYPES = st.sampled_from([None, "default", "llama3", "linear", "dynamic", "yarn"])
THETAS = st.sampled_from([None, 1e4, 5e5])


class EveryRopeSettingOfAConfigIsRead(unittest.TestCase):
    """A config.json states RoPE in two styles (4.x: rope_theta, rope_scaling; 5.x:
    rope_parameters), so a type or a theta may be given more than once. Generated over every
    slot: any type that is not 'default' is refused, wherever it is, and thetas that disagree
    are refused naming each; otherwise the one theta given is the model's. In this process, no
    weights; 40 examples, 400 long."""

    @settings(max_examples=400 if os.environ.get("SCALETORCH_LONG_TESTS") == "1" else 40,
              deadline=None)
    @given(
        types=st.fixed_dictionaries({
            ("rope_parameters", "rope_type"): ROPE_TYPES,
            ("rope_scaling", "rope_type"): ROPE_TYPES,
            ("rope_scaling", "type"): ROPE_TYPES
        }), thetas=st.fixed_dictionaries({
            ("rope_parameters", "rope_theta"): THETAS,
            (None, "rope_theta"): THETAS
        }))
    def test_a_type_or_theta_that_disagrees_is_one_line(self, types, thetas):
        from scaletorch.models import LlamaConfig
        from scaletorch.models.hf import config_from_hf, config_to_hf
        from scaletorch.rules.errors import InputError
        hf = config_to_hf(LlamaConfig(vocab_size=50, hidden_size=32, num_layers=2), torch.float32)
        for key in ("rope_theta", "rope_parameters", "rope_scaling"):
            hf.pop(key, None)
        for (section, key), value in {**types, **thetas}.items():
            if value is not None:
                (hf.setdefault(section, {}) if section else hf)[key] = value
        other = [t for t in types.values() if t not in (None, "default")]
        given_thetas = {t for t in thetas.values() if t is not None}
        if other or len(given_thetas) > 1:
            with self.assertRaises(InputError) as refused:
                config_from_hf(hf, "d/config.json")
            message = str(refused.exception)
            self.assertNotIn("\n", message)
            self.assertIn("d/config.json: ", message)
            self.assertIn(repr(other[0]) if other else "disagree", message)
            return
        theta = config_from_hf(hf, "d/config.json").rope_theta
        self.assertEqual(theta, given_thetas.pop() if given_thetas else 1e4)


@unittest.skipUnless(HAVE_HF, SKIP_REASON)
class TestHuggingFaceBadInput(unittest.TestCase):
    """Each broken directory raises one ValueError naming the file (and tensor)."""

    def setUp(self):
        from scaletorch.models import LlamaConfig, build_model
        from scaletorch.models.hf import export_hf_llama
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.dir = os.path.join(self.tmp.name, "model")
        model = build_model(LlamaConfig(vocab_size=50, hidden_size=32, num_layers=2), seed=0)
        export_hf_llama(model, self.dir, max_shard_bytes=30_000)  # several shards + index
        for name in os.listdir(self.dir):  # as the Hub gives it, without our checksums: each
            if name.endswith(".sha256"):  # edit below reaches the check it is about
                os.remove(os.path.join(self.dir, name))
        self.config_file = os.path.join(self.dir, "config.json")
        trust = boundary.trusting([self.dir])  # as --trust-unchecked names a Hub directory
        trust.__enter__()
        self.addCleanup(trust.__exit__, None, None, None)

    def assert_load_fails(self, *words):
        from scaletorch.models.hf import load_hf_llama
        with self.assertRaises(ValueError) as ctx:
            load_hf_llama(self.dir)
        for word in words:
            self.assertIn(word, str(ctx.exception))

    def edit_config(self, **changes):
        with open(self.config_file) as f:
            config = json.load(f)
        config.update(changes)
        with open(self.config_file, "w") as f:
            json.dump(config, f)

    def shard(self, index: int) -> str:
        return os.path.join(
            self.dir,
            sorted(f for f in os.listdir(self.dir) if f.endswith(".safetensors"))[index])

    def test_directory_without_config_json(self):
        os.remove(self.config_file)
        self.assert_load_fails(self.dir, "config.json")

    def test_architecture_that_is_not_llama(self):
        self.edit_config(model_type="mistral", architectures=["MistralForCausalLM"])
        self.assert_load_fails(self.config_file, "mistral", "LlamaForCausalLM")

    def test_rope_scaling_we_do_not_implement(self):
        self.edit_config(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8})
        self.assert_load_fails(self.config_file, "llama3")

    def test_missing_shard_names_the_file_and_a_tensor(self):
        missing = self.shard(1)
        os.remove(missing)
        self.assert_load_fails(missing, "model.layers")

    def test_truncated_shard_names_the_file(self):
        truncated = self.shard(0)
        with open(truncated, "r+b") as f:
            f.truncate(os.path.getsize(truncated) - 100)
        self.assert_load_fails(truncated)

    def test_a_single_file_beside_an_index_of_other_shards_is_refused_naming_both(self):
        shutil.copy(self.shard(0), os.path.join(self.dir, "model.safetensors"))
        self.assert_load_fails(self.dir, "model.safetensors and model.safetensors.index.json",
                               os.path.basename(self.shard(0)))

    def test_shape_that_disagrees_with_the_config_names_file_and_tensor(self):
        self.edit_config(intermediate_size=64)
        self.assert_load_fails(".safetensors", "mlp.", "(64, 32)")
