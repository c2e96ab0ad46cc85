"""Chapter 10: a real model on real text. Train, save, export to Hugging Face, reload, generate.

    python examples/10_real_model.py                       # one device, about a minute on a CPU
    scripts/launch.sh examples/10_real_model.py --nproc-per-node 4 -- --tp 2 --pp 2 --check \\
        --steps 10                                         # parity holds ~10 steps on text
    python examples/10_real_model.py --data.path my.txt --prompt "Once upon a time"
    python examples/10_real_model.py --init-from path/to/hf_llama --data.dataset bin \\
        --data.path my.bin --trust-unchecked path/to/hf_llama  # a Hub directory: no .sha256

Chapter 07 with real data and a way out. The text is the repository's own documentation
(README.md and doc/*.md joined into runs/10_real_model/text.txt) read as bytes: vocabulary
256, no tokenizer, no download (``--data.path FILE`` trains on yours;
``scripts/prepare_text.py`` makes a ``.bin`` for a tokenizer.json). Any layout goes through
``parallelize`` as in 07, and checkpoints are sharded (DCP) as in 07. After training, the
full weights are gathered on rank 0 (``full_state_dict``), which exports them as a Hugging
Face Llama directory (config.json + model.safetensors, which ``transformers`` loads),
reloads that directory into a fresh model and samples from it with the KV cache.

Chapter flags (the rest are the usual config overrides): --init-from DIR (start from a Hugging
Face Llama instead of the seed; its config replaces model.*, and once ``parallelize`` has
sharded the model each rank reads only its own pieces of the weights: hf_seed.py), --prompt,
--max-new-tokens, --temperature, --top-k, --top-p. The hf extra is needed (safetensors):
pip install -e ".[hf]".
"""

import glob
import math
import os
import sys

import torch

from scaletorch.data import ByteTokenizer
from scaletorch.data.tokenizer import data_tokenizer
from scaletorch.dist import (comm, destroy_distributed, destroy_pg_manager, init_distributed,
                             init_pg_manager)
from scaletorch.models import build_model
from scaletorch.models.generate import check_length, check_sampling, generate
from scaletorch.models.hf import check_hf_llama, export_hf_llama, load_hf_config, load_hf_llama
from scaletorch.parallel.activation_checkpointing import apply_activation_checkpointing
from scaletorch.parallel.mixed_precision import precision_hooks
from scaletorch.parallel.parallelize import parallelize
from scaletorch.parallel.tied_embeddings import TiedEmbeddings
from scaletorch.parallel.vocab_padding import apply_tensor_parallel_padded
from scaletorch.rules.errors import OneLineParser, clip
from scaletorch.trainer import Trainer, check_against_reference, load_config
from scaletorch.trainer.config import InputError, validate
from scaletorch.trainer.hf_seed import seed_from_hf, stored_bytes
from scaletorch.trainer.memory_limit import check_memory
from scaletorch.trainer.param_map import full_state_dict

DOCS = "README.md"  # the config's data.path: stands for README.md + doc/*.md, joined


def chapter_args() -> tuple:
    """This chapter's own flags; the rest go to load_config."""
    parser = OneLineParser(add_help=False)
    parser.add_argument("--init-from", default=None, help="a Hugging Face Llama directory")
    parser.add_argument("--prompt", default="Tensor parallel ")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8)  # 0: greedy
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=0.95)
    return parser.parse_known_args()


def limits(args):
    """This chapter's checks, made by load_config before any process starts: --init-from's
    directory is a Hugging Face Llama (config.json, every tensor's shape, floating and finite
    weights) and the layout fits its model; the sample's options fit the model, so no run
    trains and then cannot sample. A resume of the default text reads the run's own joined
    copy (``text.txt``)."""
    init_from = args.init_from

    def check(cfg, world_size: int) -> None:
        joined = os.path.join(cfg.run_path, "text.txt")
        if cfg.data.dataset == "text" and cfg.data.path == DOCS and cfg.checkpoint.resume \
                and os.path.isfile(joined):
            # a resume reads the text its run trained on, which the checkpoint's digest
            # checks (resume_check.py); the docs joined anew may have changed since
            cfg.data.path = joined
        if init_from and cfg.check:
            raise InputError("--check compares with a run from the seed; not with --init-from")
        if init_from:
            cfg.model = load_hf_config(init_from)  # its config replaces model.*
            try:  # the layout and the memory first: no tensor is read before they fit
                validate(cfg, world_size)
                check_memory(cfg, world_size)
            except ValueError as err:
                raise InputError(f"--init-from {init_from} (its config.json sets model.*): "
                                 f"{err}") from None
            check_hf_llama(init_from, values=True)
        prompt = len(ByteTokenizer().encode(args.prompt))
        try:
            check_length(prompt, args.max_new_tokens, cfg.model.max_seq_len)
        except ValueError as err:
            if prompt < 1:  # nothing to continue: refused before the run, not after it
                raise InputError(f"--prompt {clip(args.prompt)}: {err}") from None
            raise InputError(f"--max-new-tokens {args.max_new_tokens}: {err}; ask for at most "
                             f"{max(cfg.model.max_seq_len - prompt, 0)} new tokens after this "
                             f"--prompt") from None
        try:
            check_sampling(args.temperature, args.top_k, args.top_p, cfg.data.seed)
        except ValueError as err:
            raise InputError(f"--temperature, --top-k, --top-p, data.seed: {err}") from None

    return check


def shipped_text(path: str) -> str:
    """The repository's docs joined into one file (every rank writes the same bytes, atomically)."""
    texts = []
    for name in ["README.md"] + sorted(glob.glob("doc/*.md")):
        with open(name, encoding="utf-8") as f:
            texts.append(f.read())
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n\n".join(texts))
    os.replace(tmp, path)
    return path


def main() -> int:
    args, rest = chapter_args()
    cfg = load_config("examples/configs/10_real_model.yaml", "Chapter 10: a real model",
                      limits(args), argv=rest)
    env = init_distributed(cfg.training.timeout_seconds)
    if cfg.data.dataset == "text" and cfg.data.path == DOCS:
        cfg.data.path = shipped_text(os.path.join(cfg.run_path, "text.txt"))
    p = cfg.parallel
    pgm = init_pg_manager(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                          p.context_parallel_size, p.expert_model_parallel_size)
    # --init-from: the seed's model at the directory's config (limits set model.* from it)
    model = build_model(cfg.model, seed=cfg.training.model_seed)
    # what a real model needs, attached from outside: a head tied to the embedding,
    # recomputation to fit its activations (--activation-checkpointing), and a vocabulary
    # padded to a multiple of tp
    precision = precision_hooks(cfg, env.device.type)
    par = parallelize(model, cfg, pgm, env.device, precision, tied=TiedEmbeddings(),
                      recompute=apply_activation_checkpointing,
                      tensor_parallel=apply_tensor_parallel_padded)
    if args.init_from:  # a real checkpoint: each rank reads only its own pieces of its weights
        read = comm.gather_objects(seed_from_hf(args.init_from, par))
        if env.rank == 0:
            total = stored_bytes(args.init_from) / 1e6
            for rank, nbytes in enumerate(read):
                print(f"seeded from {args.init_from}: rank {rank} read {nbytes / 1e6:.3f} of "
                      f"{total:.3f} MB")
    trainer = Trainer.from_parallelized(cfg, par, pgm, device=env.device, scaler=precision.scaler)
    result = trainer.train()

    full = full_state_dict(par)  # collective: chapter 00's full weights on rank 0, None elsewhere
    if env.rank == 0:  # one device from here: full weights -> HF directory -> reload -> sample
        trained = build_model(cfg.model, seed=0)
        trained.load_state_dict(full)
        hf_dir = os.path.join(cfg.run_path, "hf")
        export_hf_llama(trained, hf_dir)
        reloaded = load_hf_llama(hf_dir)
        same = all(torch.equal(t, reloaded.state_dict()[n]) for n, t in full.items())
        tokenizer, why = data_tokenizer(cfg.data.dataset, cfg.data.path)
        vocab = tokenizer.vocab_size if tokenizer is not None else cfg.model.vocab_size
        level = "byte-level" if isinstance(tokenizer, ByteTokenizer) else "token"
        print(f"{level} loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} nats/token "
              f"(uniform over {vocab} {'bytes' if vocab == 256 else 'tokens'}: log {vocab} = "
              f"{math.log(vocab):.3f})")
        print(f"exported {hf_dir} (config.json + model.safetensors); reloaded weights "
              f"{'identical' if same else 'DIFFER'}")
        if tokenizer is None:  # ids without their tokenizer cannot be shown as text
            print(f"sample skipped: {why}")
        else:
            prompt = torch.tensor([tokenizer.encode(args.prompt)])
            out = generate(reloaded, prompt, args.max_new_tokens, args.temperature, args.top_k,
                           args.top_p, generator=torch.Generator().manual_seed(cfg.data.seed))
            print(f"sample (temperature {args.temperature}, top-p {args.top_p}, KV cache):")
            print(tokenizer.decode(out[0].tolist()))
    ok = True
    if cfg.check:
        ok = check_against_reference(cfg, result.losses, env.device, full, result.start_step,
                                     grad_norms=result.grad_norms)
    destroy_pg_manager()
    destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
