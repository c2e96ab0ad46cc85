"""Hugging Face Llama checkpoints in and out: config.json + safetensors <-> our ``Llama``.

A Hugging Face Llama directory holds ``config.json`` and the weights, either one
``model.safetensors`` or shards listed by ``model.safetensors.index.json``. Our module tree
mirrors ``LlamaForCausalLM``'s, so the name mapping is one prefix:

    HF                                          ours
    model.embed_tokens.weight                   embed_tokens.weight
    model.layers.{i}.self_attn.{q,k,v,o}_proj   layers.{i}.self_attn.{q,k,v,o}_proj
    model.layers.{i}.mlp.{gate,up,down}_proj    layers.{i}.mlp.{gate,up,down}_proj
    model.layers.{i}.{input,post_attention}_layernorm.weight   (same, without "model.")
    model.norm.weight                           norm.weight
    lm_head.weight (absent when tied)           lm_head.weight (the embedding when tied)

No permutation of q/k is needed: Hugging Face's Llama rotates channel i with channel i + d/2
("rotate_half"), and so does ``llama.apply_rope``. (Meta's original checkpoints pair channels
2i and 2i+1; Hugging Face's conversion script permutes q_proj/k_proj rows once, at conversion,
so every HF directory is already in the rotate-half layout.)

Loading reads and checks every tensor before it builds the model, so a bad directory raises
one InputError (a ValueError) naming the file and the tensor and nothing is half-loaded;
``check_hf_llama`` makes the same checks from the safetensors headers alone, before a run starts.

An export of ours writes every file whole with its sha256 beside it (``<file>.sha256``, as every
checkpoint file of a run: scaletorch/rules/safe_files.py). Loading an export of ours (its
config.json has one) verifies each file before it is parsed, and a damaged byte is an error
naming the file; a directory from the Hub carries no checksums and is read as it is.
Needs the optional ``hf`` extra (``pip install -e ".[hf]"``) for ``safetensors``.
"""

import dataclasses
import json
import os
import typing
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from scaletorch.models.llama import Llama, LlamaConfig
from scaletorch.rules import boundary
from scaletorch.rules.errors import InputError, MissingInputError, clip
from scaletorch.rules.safe_files import write_checksummed
from scaletorch.rules.schema import (MAX_LAYERS, check_value, checked, count, positive, rules_of,
                                     text)

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURE = "LlamaForCausalLM"
HF_PREFIX = "model."
# Buffers some older exports saved; recomputed from the config, so skipped on load.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", )
# A file of a Hugging Face directory larger than this is not one (weights are memory-mapped
# and read by rectangles, so the limit is the disk's, not the host's memory)
MAX_FILE_BYTES = 1 << 40


def require_hf(module: str) -> Any:
    """Import an optional dependency of the ``hf`` extra, or say how to install it."""
    try:
        return __import__(module)
    except ImportError as err:
        raise ImportError(f"{module} is needed for Hugging Face checkpoints and tokenizers: "
                          f'pip install -e ".[hf]" (or pip install {module})') from err


def to_hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face name (lm_head stays at the top)."""
    return name if name.startswith("lm_head.") else HF_PREFIX + name


def from_hf_name(name: str) -> str:
    """A Hugging Face parameter name -> ours."""
    return name[len(HF_PREFIX):] if name.startswith(HF_PREFIX) else name


@dataclass
class HFLlamaFields:
    """The fields of a Llama config.json that we read, each with its type and rule, as the
    value stands in the file: "2048" is no int, null no float, "true" no boolean. A field
    left out takes the default; those without one (None, not Optional) must be there."""
    model_type: str = checked(None, text())
    architectures: List[str] = checked(None, text())
    vocab_size: int = checked(None, positive())
    hidden_size: int = checked(None, positive())
    intermediate_size: int = checked(None, positive())
    num_hidden_layers: int = checked(None, count(MAX_LAYERS))
    num_attention_heads: int = checked(None, positive())
    num_key_value_heads: Optional[int] = checked(None, positive())  # absent or null: the heads
    head_dim: Optional[int] = checked(None, positive())  # absent or null: hidden / heads
    max_position_embeddings: int = checked(2048, positive())
    rms_norm_eps: float = checked(1e-6, positive())
    rope_theta: float = checked(10000.0, positive())  # or rope_parameters.rope_theta (5.x)
    tie_word_embeddings: bool = checked(False)
    hidden_act: str = checked("silu", text())
    attention_bias: bool = checked(False)
    mlp_bias: bool = checked(False)


def read_fields(hf: Dict[str, Any], path: str) -> Dict[str, Any]:
    """Every field of ``HFLlamaFields`` from config dict ``hf`` (a default where it is left
    out), checked against its type and rule: InputError naming ``path``, the field and value."""
    values = {}
    for name, annotation, rule, default in rules_of(HFLlamaFields):
        value = _rope_theta(hf, path) if name == "rope_theta" else hf.get(name, default)
        if value is None and typing.get_origin(annotation) is not typing.Union:
            if name not in hf:
                raise InputError(f"{path}: {name} is missing; a Llama config.json sets it "
                                 f"({rule.allowed(annotation)})")
            raise InputError(f"{path}: {name} must be {rule.allowed(annotation)}, got null")
        try:
            check_value(name, value, annotation, rule)
        except InputError as err:
            raise InputError(f"{path}: {err}") from None
        values[name] = value
    return values


def _rope_theta(hf: Dict[str, Any], path: str) -> Any:
    """RoPE theta from either config style, refusing scaled RoPE we do not implement.

    transformers >= 5 writes ``rope_parameters: {rope_type, rope_theta}``; 4.x wrote a top-level
    ``rope_theta`` and ``rope_scaling`` (null or {type/rope_type, factor, ...}).
    """
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise InputError(f"{path}: {name} must be an object or null, got {value!r}")
    # every rope type the file states, in either style: one that is not plain RoPE is refused
    # even when another key says "default" (no order decides which one transformers reads)
    types = {
        f"{name}.{key}": part[key]
        for name, part in (("rope_parameters", params), ("rope_scaling", scaling))
        for key in ("rope_type", "type") if part.get(key) is not None
    }
    for where, rope_type in types.items():
        if rope_type != "default":
            raise InputError(
                f"{path}: rope type {clip(rope_type)} ({where}) is not supported: our Llama "
                f"implements plain RoPE (rope_type 'default') with a theta; Llama 3.1+ style "
                f"'llama3', 'linear', 'dynamic' and 'yarn' scaling change the frequencies and "
                f"would give different logits")
    thetas = {
        f"{name}.rope_theta": part["rope_theta"]
        for name, part in (("rope_parameters", params), ("rope_scaling", scaling))
        if "rope_theta" in part
    }
    if "rope_theta" in hf:
        thetas["rope_theta"] = hf["rope_theta"]
    if len(set(map(repr, thetas.values()))) > 1:
        raise InputError(f"{path}: RoPE theta is given {len(thetas)} ways that disagree ("
                         f"{', '.join(f'{k} {clip(v)}' for k, v in thetas.items())}): keep one")
    return params.get("rope_theta", hf.get("rope_theta", 10000.0))


def config_from_hf(hf: Dict[str, Any], path: str = CONFIG_FILE) -> LlamaConfig:
    """A Hugging Face Llama config dict -> our LlamaConfig (InputError naming ``path`` for a
    value of the wrong type or range, and for what we lack)."""
    architectures = hf.get("architectures") or []
    if hf.get("model_type") != "llama" or ARCHITECTURE not in architectures:
        raise InputError(f"{path}: model_type {hf.get('model_type')!r} / architectures "
                         f"{architectures} is not a Llama ({ARCHITECTURE}, model_type 'llama'): "
                         f"only Hugging Face Llama directories load here")
    f = read_fields(hf, path)
    for key, wanted in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if f[key] != wanted:
            raise InputError(f"{path}: {key} = {f[key]!r} is not supported (ours: {wanted!r})")
    heads = f["num_attention_heads"]
    head_dim = f["head_dim"] or f["hidden_size"] // heads
    if head_dim * heads != f["hidden_size"]:
        raise InputError(f"{path}: head_dim {head_dim} x num_attention_heads {heads} != "
                         f"hidden_size {f['hidden_size']}; ours needs head_dim = hidden / heads")
    try:
        return LlamaConfig(vocab_size=f["vocab_size"], hidden_size=f["hidden_size"],
                           intermediate_size=f["intermediate_size"],
                           num_layers=f["num_hidden_layers"], num_attention_heads=heads,
                           num_key_value_heads=f["num_key_value_heads"] or heads,
                           max_seq_len=f["max_position_embeddings"], rope_theta=f["rope_theta"],
                           norm_eps=f["rms_norm_eps"], tie_word_embeddings=f["tie_word_embeddings"])
    except ValueError as err:  # e.g. heads that do not divide: still this file's values
        raise InputError(f"{path}: {err}") from None


def config_to_hf(config: LlamaConfig, dtype: torch.dtype) -> Dict[str, Any]:
    """Our LlamaConfig -> a config.json that transformers 4.x and 5.x both read."""
    if config.num_experts > 0:
        raise ValueError(f"a mixture-of-experts model (num_experts {config.num_experts}) has "
                         f"no LlamaForCausalLM equivalent")
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,  # 4.x reads this, 5.x reads rope_parameters
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": config.rope_theta
        },
        "tie_word_embeddings": config.tie_word_embeddings,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "dtype": str(dtype).removeprefix("torch.")
    }


def load_hf_config(path: str) -> LlamaConfig:
    """Read ``path/config.json`` into our LlamaConfig."""
    if not os.path.exists(path):
        raise MissingInputError(f"Hugging Face directory {path} does not exist: give a directory "
                                f"that holds {CONFIG_FILE} and the safetensors files")
    if not os.path.isdir(path):
        raise InputError(f"{path} is a file, not a Hugging Face model directory: give the "
                         f"directory that holds {CONFIG_FILE} and the safetensors files")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.lexists(file):
        raise InputError(f"{path} is not a Hugging Face model directory: {CONFIG_FILE} is missing; "
                         f"give the directory that holds it and the safetensors files")
    verify_export_file(file)
    hf = boundary.load_json(file, "Hugging Face config", digest=False)  # verified just above
    return config_from_hf(hf, file)


def _weight_files(path: str) -> Dict[str, List[str]]:
    """{safetensors file: [HF tensor names it should hold]} (names empty: read them all)."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        verify_export_file(index)
        values = boundary.load_json(index, "safetensors index", digest=False)  # verified above
        try:
            weight_map = values["weight_map"]
            bad = [(k, v) for k, v in weight_map.items() if not isinstance(v, str)]
            if bad:  # an InputError, not caught below
                raise InputError(f"{index}: weight_map gives {clip(bad[0][0], 80)} the shard "
                                 f"{clip(bad[0][1], 60)}, not a file name")
            files_named = [os.path.join(path, file) for file in weight_map.values()]
        except (KeyError, TypeError, AttributeError) as err:
            raise InputError(f"{index} is not a safetensors index (a JSON object with a "
                             f"weight_map): {clip(str(err))}") from None
        outside = [
            f for f in files_named if os.path.dirname(os.path.normpath(f)) != os.path.normpath(path)
        ]
        if outside:
            raise InputError(f"{index} names a shard outside its directory: {clip(outside[0])}")
        files: Dict[str, List[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(os.path.join(path, file), []).append(name)
        single = os.path.join(path, SINGLE_FILE)
        others = sorted(os.path.basename(f) for f in files if f != single)
        if os.path.lexists(single) and (others or not files):  # two sets of weights
            raise InputError(f"{path} holds both {SINGLE_FILE} and {INDEX_FILE}, whose weight_map "
                             f"names {clip(others[0]) if others else 'no file'}"
                             f"{' and more' if len(others) > 1 else ''}: which weights are meant "
                             f"is unclear; remove one of the two")
        for file, names in files.items():
            if not os.path.lexists(file):
                raise InputError(f"shard {file} listed in {index} is missing (it holds "
                                 f"{names[0]} and {len(names) - 1} more tensors)")
            boundary.regular_file(file, f"shard listed in {index}", MAX_FILE_BYTES)
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.lexists(index):  # there, but not a file: say what it is
        boundary.regular_file(index, "safetensors index", boundary.JSON_BYTES)
    if not os.path.lexists(single):
        raise InputError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    boundary.regular_file(single, "Hugging Face weights", MAX_FILE_BYTES)
    return {single: []}


def _read_file(file: str, names: List[str]) -> Dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (those of ``names`` at least), checked readable."""
    safetensors = require_hf("safetensors")
    from safetensors.torch import safe_open
    verify_export_file(file)  # every byte, before the header is parsed
    out: Dict[str, torch.Tensor] = {}
    current = "the header"
    try:
        with safe_open(file, framework="pt") as f:
            keys = list(f.keys())
            for name in names:
                if name not in keys:
                    raise InputError(f"{file} does not hold {name}, which the index says it does")
            for current in keys:
                out[current] = f.get_tensor(current)
    except safetensors.SafetensorError as err:
        # A truncated file fails on its header or when a tensor's bytes run past its end.
        raise InputError(f"{file} is not a readable safetensors file (reading {current}): "
                         f"{err}") from err
    return out


def _read_shapes(file: str, names: List[str]) -> Dict[str, tuple]:
    """Every tensor's shape in one safetensors file, from its header (no weights are read)."""
    safetensors = require_hf("safetensors")
    from safetensors.torch import safe_open
    boundary.verified(file, "Hugging Face file", content=False)  # hashed when weights load
    try:
        # safe_open checks that the header's offsets cover the file: a truncated one fails here
        with safe_open(file, framework="pt") as f:
            keys = list(f.keys())
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in keys}
    except safetensors.SafetensorError as err:
        raise InputError(f"{file} is not a readable safetensors file ({err}): it is truncated or "
                         f"damaged; download or export it again") from None
    for name in names:
        if name not in shapes:
            raise InputError(f"{file} does not hold {name}, which the index says it does")
    return shapes


def _our_name(file: str, hf_name: str, shape: tuple, expected: Dict[str, tuple],
              path: str) -> Optional[str]:
    """Our name for tensor ``hf_name`` of ``file`` (None: a buffer we skip); InputError when
    a Llama of ``path``'s config.json has no such tensor or another shape."""
    if hf_name.endswith(IGNORED_SUFFIXES):
        return None
    name = from_hf_name(hf_name)
    if name not in expected:
        raise InputError(f"{file}: tensor {hf_name} is not part of a Llama with this "
                         f"config ({path}/{CONFIG_FILE})")
    if shape != expected[name]:
        raise InputError(f"{file}: tensor {hf_name} has shape {shape}, but "
                         f"{CONFIG_FILE} implies {expected[name]}")
    return name


def tensor_files(path: str) -> Dict[str, Tuple[str, tuple]]:
    """{HF tensor name: (safetensors file, shape)} of Hugging Face directory ``path``, from the
    index and the safetensors headers: no weights are read."""
    out: Dict[str, Tuple[str, tuple]] = {}
    for file, names in _weight_files(path).items():
        for hf_name, shape in _read_shapes(file, names).items():
            out[hf_name] = (file, shape)
    return out


def check_hf_llama(path: str, values: bool = False) -> LlamaConfig:
    """The LlamaConfig of Hugging Face directory ``path``, once its config.json and every
    tensor's name and shape (from the safetensors headers) are checked: InputError naming the
    file otherwise. A run calls it before any process starts. ``values`` (``--init-from``):
    every weight is also read, one at a time, and checked floating and finite
    (``check_weight``), as ``load_hf_state_dict`` checks them."""
    config = load_hf_config(path)
    expected = {name: tuple(p.shape) for name, p in _shapes(config).items()}
    found: set = set()
    for file, names in _weight_files(path).items():
        for hf_name, shape in _read_shapes(file, names).items():
            found.add(_our_name(file, hf_name, shape, expected, path))
    missing = [to_hf_name(n) for n in expected if n not in found]
    if missing:
        raise InputError(f"{path}: {len(missing)} tensors missing, e.g. {missing[0]}")
    if values:
        for file in _weight_files(path):
            _check_values(file)
    return config


def check_weight(file: str, hf_name: str, tensor: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> None:
    """InputError naming ``file`` and the tensor unless it is floating point and finite once
    cast to ``dtype``, the dtype of the parameter it is loaded into."""
    if not tensor.is_floating_point():
        raise InputError(f"{file}: tensor {hf_name} is {tensor.dtype}, not a floating point "
                         f"weight")
    problem = boundary.not_finite_as(tensor, dtype)
    if problem:
        raise InputError(f"{file}: tensor {hf_name} {problem}: the weights are damaged or from "
                         f"a diverged run")


def _check_values(file: str) -> None:
    """``check_weight`` on every weight of one safetensors file, one tensor in memory at a
    time, after its bytes match their digest (or the user trusted them)."""
    safetensors = require_hf("safetensors")
    from safetensors.torch import safe_open
    verify_export_file(file)
    try:
        with safe_open(file, framework="pt") as f:
            for hf_name in f.keys():
                if not hf_name.endswith(IGNORED_SUFFIXES):
                    check_weight(file, hf_name, f.get_tensor(hf_name))
    except safetensors.SafetensorError as err:
        raise InputError(f"{file} is not a readable safetensors file ({err})") from None


def load_hf_state_dict(path: str, config: LlamaConfig,
                       dtype: torch.dtype = torch.float32) -> Dict[str, torch.Tensor]:
    """All weights of an HF directory, renamed to ours and checked against ``config``.

    Raises ValueError naming the file and tensor for a missing, unexpected or misshapen tensor,
    one that is not floating point, or one that holds inf or nan once cast to ``dtype``.
    """
    expected = {name: tuple(p.shape) for name, p in _shapes(config).items()}
    state: Dict[str, torch.Tensor] = {}
    origin: Dict[str, str] = {}
    for file, names in _weight_files(path).items():
        for hf_name, tensor in _read_file(file, names).items():
            name = _our_name(file, hf_name, tuple(tensor.shape), expected, path)
            if name is not None:
                check_weight(file, hf_name, tensor, dtype)
                state[name], origin[name] = tensor, file
    if config.tie_word_embeddings and "lm_head.weight" in state:
        # Some tied exports save both; they must be the same tensor for the tie to hold.
        if not torch.equal(state.pop("lm_head.weight"), state["embed_tokens.weight"]):
            raise InputError(f"{origin['lm_head.weight']}: lm_head.weight differs from "
                             f"model.embed_tokens.weight but the config ties them")
    missing = [to_hf_name(n) for n in expected if n not in state]
    if missing:
        raise InputError(f"{path}: {len(missing)} tensors missing, e.g. {missing[0]}")
    return state


def _shapes(config: LlamaConfig) -> Dict[str, torch.Tensor]:
    """Our parameter names -> meta tensors of their shapes (tied lm_head omitted), from a
    one-block model on the meta device: every block of a Hugging Face Llama has block 0's
    tensors, so the cost does not grow with num_layers (a model of them all would take
    seconds per thousand blocks, before the memory check could refuse it)."""
    with torch.device("meta"):
        model = Llama(dataclasses.replace(config, num_layers=1))
    # named_parameters lists a tied tensor once
    one: Dict[str, torch.Tensor] = dict(model.named_parameters())
    names = {n: p for n, p in one.items() if not n.startswith("layers.0.")}
    for i in range(config.num_layers):
        names.update({
            f"layers.{i}.{n[len('layers.0.'):]}": p
            for n, p in one.items() if n.startswith("layers.0.")
        })
    return names


def load_hf_llama(path: str, dtype: torch.dtype = torch.float32) -> Llama:
    """Build our Llama from a Hugging Face Llama directory, weights cast to ``dtype``."""
    config = load_hf_config(path)
    state = load_hf_state_dict(path, config, dtype)  # all checked before a model exists
    with torch.device("meta"):
        model = Llama(config)
    model.to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty keeps the tie; re-point it to be sure
        model.lm_head.weight = model.embed_tokens.weight
    model.load_state_dict({n: t.to(dtype) for n, t in state.items()}, strict=False)
    return model.to(dtype)


def hf_state_dict(model: Llama, dtype: Optional[torch.dtype] = None) -> Dict[str, torch.Tensor]:
    """Our model's weights under HF names, contiguous, tied lm_head omitted."""
    out = {}
    for name, param in model.named_parameters():  # lists a tied weight once (the embedding)
        tensor = param.detach().to("cpu", dtype or param.dtype).contiguous()
        out[to_hf_name(name)] = tensor
    return out


def export_hf_llama(model: Llama, path: str, dtype: Optional[torch.dtype] = None,
                    max_shard_bytes: Optional[int] = None) -> List[str]:
    """Write ``model`` as a Hugging Face Llama directory; returns the files written.

    dtype: the stored dtype (default: the model's). max_shard_bytes: split the weights into
    shards of at most this size with an index, as ``save_pretrained`` does for large models.
    Every file is written whole with its ``.sha256`` beside it (``write_checksummed``; a full
    disk is a WriteError naming the file); config.json comes last, and its checksum marks the
    directory as an export of ours, which loading verifies.
    """
    require_hf("safetensors")
    from safetensors.torch import save
    state = hf_state_dict(model, dtype)
    stored = next(iter(state.values())).dtype
    shards = _split(state, max_shard_bytes)
    files, weight_map = [], {}
    for i, shard in enumerate(shards):
        name = SINGLE_FILE if len(shards) == 1 else \
            f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        files.append(os.path.join(path, name))
        write_checksummed(files[-1], save(shard, metadata={"format": "pt"}))
        weight_map.update({tensor: name for tensor in shard})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in state.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        files.insert(0, os.path.join(path, INDEX_FILE))
        write_checksummed(files[0], _json(index))
    files.insert(0, os.path.join(path, CONFIG_FILE))
    write_checksummed(files[0], _json(config_to_hf(model.config, stored)))
    return files


def _json(value: Any) -> bytes:
    return json.dumps(value, indent=2).encode()


def verify_export_file(file: str) -> None:
    """CorruptFileError naming ``file`` unless it matches its ``.sha256`` (every export of ours
    writes one), or the user named it or its directory with ``--trust-unchecked`` (a Hub
    directory has none). A missing digest is an error, so removing one checks nothing less."""
    boundary.regular_file(file, "Hugging Face file", MAX_FILE_BYTES)
    boundary.verified(file, "Hugging Face file")


def _split(state: Dict[str, torch.Tensor],
           max_bytes: Optional[int]) -> List[Dict[str, torch.Tensor]]:
    """Consecutive groups of tensors of at most max_bytes each (a larger tensor alone)."""
    if max_bytes is None:
        return [state]
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards
