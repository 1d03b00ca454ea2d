"""Hugging Face ``transformers`` causal LMs, built locally (never downloaded).

``transformers`` is an optional extra (``pip install fullshard[hf]``) and is imported only when a
Hugging Face model is asked for. A model comes from one of the built-in configuration dicts in
:data:`HF_CONFIGS` (random init) or from a local directory holding a ``config.json`` (random init)
plus, optionally, weights (loaded). Each decoder layer becomes one FSDP unit.

A directory with safetensors weights can be built *lazily* (``lazy_weights=True``): parameters on
the meta device, buffers real, and the checkpoint remembered on the model; :func:`load_pending`
then materialises the sharded model and has each rank read only its own rows
(:func:`fullshard.checkpoint.load_safetensors`), so no rank ever holds the whole model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "HF_CONFIGS",
    "build_hf_model",
    "config_vocab_size",
    "find_decoder_layers",
    "load_pending",
    "require_transformers",
    "safetensors_dir",
]

INSTALL_HINT = (
    "Hugging Face models need the optional `transformers` package: "
    "`pip install 'fullshard[hf]'` (or `pip install transformers`)."
)

# Built-in configurations: name -> (model_type, config kwargs). vocab_size comes from the
# tokenizer at build time.
HF_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        ),
    ),
    "gpt2-tiny": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
    "gpt2": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, n_positions=1024)),
    "llama-1b": (
        "llama",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=2048,
        ),
    ),
}

# Where common architectures keep their decoder layers (dotted attribute paths).
_LAYER_PATHS = ("model.layers", "transformer.h", "gpt_neox.layers", "model.decoder.layers")
_SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
_WEIGHT_FILES = (*_SAFETENSORS_FILES, "pytorch_model.bin")
# The checkpoint (and device) a lazily built model still has to load: set by build_hf_model,
# consumed by load_pending.
_PENDING = "_fullshard_pending_weights"


def require_transformers() -> Any:
    """Import and return ``transformers``, or raise ``ImportError`` saying how to install it."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return transformers


def _hf_config(spec: str, vocab_size: int | None) -> tuple[Any, bool]:
    """Return (config, has_weights) for a built-in name or a local directory."""
    transformers = require_transformers()
    if spec in HF_CONFIGS:
        model_type, kwargs = HF_CONFIGS[spec]
        config = transformers.AutoConfig.for_model(model_type, **kwargs)
        has_weights = False
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            known = ", ".join(f"hf:{n}" for n in HF_CONFIGS)
            raise ValueError(
                f"Hugging Face model {spec!r} is neither a built-in config ({known}) nor a local "
                "directory with a config.json (nothing is downloaded)."
            )
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        has_weights = any((path / f).is_file() for f in _WEIGHT_FILES)
    if vocab_size is not None and not has_weights:
        config.vocab_size = vocab_size
        # Special-token ids of the original vocabulary may not exist in a small (byte) one.
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and value >= vocab_size:
                setattr(config, attr, None)
    return config, has_weights


def config_vocab_size(spec: str) -> int | None:
    """The vocabulary a local Hugging Face directory's ``config.json`` declares; ``None`` for a
    built-in name (:data:`HF_CONFIGS` have none: theirs comes from the tokenizer)."""
    if spec in HF_CONFIGS:
        return None
    config, _ = _hf_config(spec, None)
    # a multimodal config keeps its language model's vocabulary in its text config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _fp32(transformers: Any) -> dict[str, torch.dtype]:
    """The keyword that builds a model in float32 (transformers 4.56 renamed ``torch_dtype``)."""
    from packaging.version import Version

    new = Version(transformers.__version__) >= Version("4.56")
    return {"dtype" if new else "torch_dtype": torch.float32}


def safetensors_dir(spec: str) -> Path | None:
    """The directory of ``spec`` when it is a local Hugging Face checkpoint with safetensors
    weights (``model.safetensors`` or its index), else ``None``."""
    path = Path(spec)
    if spec in HF_CONFIGS or not (path / "config.json").is_file():
        return None
    return path if any((path / f).is_file() for f in _SAFETENSORS_FILES) else None


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    """Every parameter registered inside goes to the meta device; buffers are built normally.

    Why not ``with torch.device("meta")``: buffers computed at construction (rotary
    ``inv_freq``, causal masks) are often non-persistent, i.e. in no checkpoint, so they must be
    real from the start. A parameter's (empty, untouched) CPU storage is dropped at once.
    """
    register = nn.Module.register_parameter

    def to_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(self, name, param)

    nn.Module.register_parameter = to_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_hf_model(
    spec: str,
    vocab_size: int | None,
    *,
    seed: int = 0,
    device: torch.device | str | None = None,
    lazy_weights: bool = False,
) -> nn.Module:
    """Build a ``transformers`` causal LM from a built-in name or a local directory.

    Configuration-only models are randomly initialised from ``seed`` with ``vocab_size`` tokens;
    a directory with weights is loaded as is (its vocabulary must cover the tokenizer's, which
    the trainer checks). With ``lazy_weights`` a directory with safetensors weights is built
    with its parameters on the meta device (buffers on ``device``) and loads nothing yet: shard
    it, then :func:`load_pending` (``fullshard.app.models.wrap.shard_model`` does both). With
    ``device="meta"`` the parameters are made on the meta device directly (no init, no load: any
    size costs no memory). The returned model gets a ``unit_types`` attribute: its decoder layer
    classes.
    """
    transformers = require_transformers()
    config, has_weights = _hf_config(spec, vocab_size)
    # on the meta device nothing would be kept of loaded weights or of a random init: build the
    # parameters there from the start (an 8B config built on the CPU first needs 32 GB)
    on_meta = device is not None and torch.device(device).type == "meta"
    weights = safetensors_dir(spec) if (lazy_weights or on_meta) and has_weights else None
    # fork_rng: seed the init without disturbing the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if weights is not None or on_meta:
            with _params_on_meta():
                model = transformers.AutoModelForCausalLM.from_config(config, **_fp32(transformers))
            target = torch.device(device or "cpu")
            for module in model.modules():  # the buffers only: parameters wait on meta
                for name, buf in module._buffers.items():
                    if buf is not None:
                        module._buffers[name] = buf.to(target)
            if weights is not None and target.type != "meta":
                setattr(model, _PENDING, (weights, target))
            device = None
        elif has_weights:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                spec, local_files_only=True, **_fp32(transformers)
            )
        else:
            model = transformers.AutoModelForCausalLM.from_config(config)
    if device is not None:
        model = model.to(device)
    layers = find_decoder_layers(model)
    model.unit_types = tuple(dict.fromkeys(type(layer) for layer in layers))
    return model


def load_pending(model: nn.Module) -> bool:
    """Materialise a lazily built model (see :func:`build_hf_model`) and load its safetensors
    weights, each rank reading only its own rows; ``False`` when nothing was pending.

    Call it after sharding (on every rank). ``to_empty`` would leave the buffers uninitialised,
    so they are kept and put back; a tied parameter stays one parameter (the sharding engine
    re-points every name of it at the materialised tensor).
    """
    pending = getattr(model, _PENDING, None)
    if pending is None:
        return False
    from fullshard.checkpoint import load_safetensors

    path, device = pending
    buffers = [
        (module, name, buf)
        for module in model.modules()
        for name, buf in module._buffers.items()
        if buf is not None
    ]
    model.to_empty(device=device)
    for module, name, buf in buffers:
        module._buffers[name] = buf
    load_safetensors(model, path)
    delattr(model, _PENDING)
    return True


def find_decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a causal LM, in order.

    Tries the attribute paths of common architectures, then falls back to the longest
    ``ModuleList`` whose children all share one class. Raises ``ValueError`` if none is found.
    """
    for path in _LAYER_PATHS:
        obj: Any = model
        for attr in path.split("."):
            obj = getattr(obj, attr, None)
        if isinstance(obj, nn.ModuleList) and len(obj) > 0:
            return list(obj)
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            children = list(module)
            if len({type(c) for c in children}) == 1:
                best = children
    if not best:
        raise ValueError(
            f"could not find the decoder layers of {type(model).__name__}: expected one of "
            f"{', '.join(_LAYER_PATHS)} or a ModuleList of identical layers"
        )
    return best
