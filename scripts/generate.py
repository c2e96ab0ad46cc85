"""Sample from a trained model on one device: a Hugging Face Llama directory or a consolidated
checkpoint; optionally compare it with ``transformers`` on the same weights.

    python scripts/generate.py runs/10_real_model/hf --prompt "Tensor parallel "
    python scripts/convert_dcp.py runs/10_real_model/checkpoints/step_0000200 \\
        --consolidated runs/10_real_model/consolidated.pt   # a run with --checkpoint.every
    python scripts/generate.py runs/10_real_model/consolidated.pt \\
        --config runs/10_real_model/config.yaml --temperature 0
    python scripts/generate.py runs/10_real_model/hf --compare-transformers

The tokenizer is the directory's tokenizer.json when it has one, else bytes (``--tokenizer``
overrides). ``--compare-transformers`` (the hf extra) loads the directory with
``transformers.LlamaForCausalLM`` too and prints the largest logit difference on the prompt and
whether greedy generation gives the same tokens.
"""

import argparse
import os
import sys
from typing import Any, List, Optional, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scaletorch.data import load_tokenizer  # noqa: E402
from scaletorch.models import Llama, build_model  # noqa: E402
from scaletorch.models.generate import check_length, check_sampling, generate  # noqa: E402
from scaletorch.models.hf import load_hf_llama  # noqa: E402
from scaletorch.rules import boundary  # noqa: E402
from scaletorch.rules.errors import InputError, OneLineParser  # noqa: E402


def load_model(source: str, config_file: str) -> Llama:
    """Our Llama from an HF directory, or from a consolidated .pt plus the run's config.yaml."""
    if os.path.isdir(source):
        return load_hf_llama(source)
    from scaletorch.trainer.checkpoint import check_consolidated_state
    from scaletorch.trainer.config import Config, apply_dict, check_schema, load_yaml
    from scaletorch.trainer.consolidated import load_consolidated
    cfg = Config()
    apply_dict(cfg, load_yaml(config_file), source=config_file)
    check_schema(cfg)
    state = load_consolidated(source)  # verified against its digest, tensors only
    check_consolidated_state(f"consolidated checkpoint {source!r}", state, cfg.model,
                             f"--config {config_file}'s model",
                             "give the config.yaml of the run that wrote it with --config")
    model = build_model(cfg.model, seed=0)
    model.load_state_dict(state["model"])
    return model


def compare_with_transformers(path: str, model: Llama, prompt: torch.Tensor, new: int) -> bool:
    """Print max |our logits - transformers' logits| and whether greedy tokens agree."""
    try:
        import transformers
    except ImportError:
        print('--compare-transformers needs transformers: pip install -e ".[hf]"')
        return False
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    theirs = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        diff = (model(prompt) - theirs(prompt).logits).abs().max().item()
    theirs.generation_config.eos_token_id = None  # generate all `new` tokens, as ours does
    expected = theirs.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    same = torch.equal(generate(model, prompt, new), expected)
    print(f"max |logits - transformers| = {diff:.1e} over {tuple(prompt.shape)} prompt tokens")
    print(f"greedy, {new} new tokens: {'identical' if same else 'DIFFERENT'} tokens")
    return same and diff <= 1e-4


def checked_inputs(args: argparse.Namespace) -> Tuple[torch.Tensor, Llama, Any]:
    """(prompt ids (1, s0), model, tokenizer) once every input is checked, before any token is
    generated: the sampling arguments first (nothing loaded), then the model (its names and
    shapes against the config), the tokenizer against the model's vocabulary, and the prompt
    plus the new tokens against its positions. ValueError (an InputError) naming the values."""
    boundary.trust_unchecked(args.trust_unchecked)
    try:
        check_sampling(args.temperature, args.top_k, args.top_p, args.seed)
        check_length(1, args.max_new_tokens, sys.maxsize)  # >= 0; the positions once loaded
    except ValueError as err:
        raise InputError(f"{err}: give --temperature, --top-k, --top-p, --seed and "
                         f"--max-new-tokens in those ranges") from None
    model = load_model(args.source, args.config)
    spec = args.tokenizer
    if spec is None:
        has_file = os.path.isfile(os.path.join(args.source, "tokenizer.json"))
        spec = args.source if has_file else "byte"
    tokenizer = load_tokenizer(spec)
    vocab = model.config.vocab_size
    if tokenizer.vocab_size > vocab:  # the prompt's ids would index past the embedding
        raise InputError(f"the tokenizer ({spec}) has {tokenizer.vocab_size} tokens, the model "
                         f"{vocab}: give the tokenizer the model was trained with (--tokenizer)")
    ids = tokenizer.encode(args.prompt)
    try:
        check_length(len(ids), args.max_new_tokens, model.config.max_seq_len)
    except ValueError as err:
        raise InputError(f"{err}: give a --prompt of 1 to {model.config.max_seq_len} tokens "
                         f"with --max-new-tokens") from None
    return torch.tensor([ids]), model, tokenizer


def main(argv: Optional[List[str]] = None) -> int:
    """The command line above (``argv``: its arguments, sys.argv's by default); 0, or 2 on
    a bad source."""
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a Hugging Face Llama directory or a consolidated .pt")
    parser.add_argument("--config", default="examples/configs/10_real_model.yaml",
                        help="the run's config (for a consolidated .pt: the model's shape)")
    parser.add_argument("--tokenizer", default=None, help='"byte" or a tokenizer.json')
    parser.add_argument("--prompt", default="Tensor parallel ")
    parser.add_argument("--max-new-tokens", type=int, default=60)
    parser.add_argument("--temperature", type=float, default=0.0)  # 0: greedy
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    boundary.add_trust_flag(parser)
    parser.add_argument("--compare-transformers", action="store_true")
    args = parser.parse_args(argv)
    try:
        prompt, model, tokenizer = checked_inputs(args)
    except (OSError, ValueError, ImportError) as err:  # InputError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.compare_transformers:
        return 0 if compare_with_transformers(args.source, model, prompt,
                                              args.max_new_tokens) else 1
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                   generator=torch.Generator().manual_seed(args.seed))
    print(tokenizer.decode(out[0].tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
