"""Reading and checking PEFT LoRA adapter directories for the built-in engine.

Weights load only from `adapter_model.safetensors`: a pickle (`adapter_model.bin`) can run code
when it is unpickled, so it is refused even when it sits next to a valid config.
"""
import json
import math
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

from safetensors.torch import load_file

from .lora import TARGET_MODULES

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_NAME = "adapter_config.json"


class AdapterError(Exception):
    """An adapter that cannot be served; carries vLLM's error type and the HTTP status."""

    def __init__(self, message, *, err_type="BadRequestError", status_code=HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.message = message
        self.err_type = err_type
        self.status_code = int(status_code)


@dataclass
class AdapterWeights:
    """Args: modules: module name in the model (e.g. "model.layers.0.self_attn.q_proj") -> (A [r, in], B [out, r])."""

    path: str
    rank: int
    scaling: float
    modules: dict
    size_bytes: int


def check_adapter_config(config, *, max_rank):
    """Return the config's rank and scaling, or raise AdapterError saying what is not supported."""
    def refuse(why):
        raise AdapterError(f"Unsupported adapter config: {why}.")

    if str(config.get("peft_type", "")).upper() != "LORA":
        refuse(f"peft_type is {config.get('peft_type')!r}, only 'LORA' is served")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        refuse(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        refuse(f"rank {rank} is greater than the engine's max LoRA rank {max_rank}")
    targets = config.get("target_modules")
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    bad = sorted(set(targets) - set(TARGET_MODULES))
    if not targets or bad:
        refuse(f"target_modules must be among {', '.join(TARGET_MODULES)}; got {bad or 'none'}")
    if config.get("use_dora"):
        refuse("DoRA (use_dora) is not supported")
    if config.get("modules_to_save"):
        refuse("modules_to_save is not supported")
    if config.get("bias", "none") != "none":
        refuse(f"bias must be 'none', got {config.get('bias')!r}")
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        refuse("rank_pattern / alpha_pattern are not supported")
    for key in ("layers_to_transform", "layer_replication", "trainable_token_indices"):
        if config.get(key):
            refuse(f"{key} is not supported")
    alpha = config.get("lora_alpha", 8)
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def read_adapter(path, *, max_rank, module_shapes):
    """Read and check a PEFT LoRA directory.

    Args:
        path: the adapter directory.
        max_rank: the largest rank the engine serves.
        module_shapes: module name -> (in_features, out_features) of every LoRA-capable Linear.
    Returns: AdapterWeights. Raises AdapterError (404 for a missing directory, else 400).
    """
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError(f"No adapter found for {path}", err_type="NotFoundError", status_code=HTTPStatus.NOT_FOUND)
    weights_file = directory / WEIGHTS_NAME
    if not weights_file.is_file():
        pickles = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt"))
        hint = f" (found {', '.join(pickles)}; pickle files are never loaded)" if pickles else ""
        raise AdapterError(f"Adapter at {path} has no {WEIGHTS_NAME}{hint}.")
    try:
        config = json.loads((directory / CONFIG_NAME).read_text())
    except FileNotFoundError:
        raise AdapterError(f"Adapter at {path} has no {CONFIG_NAME}.") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"Adapter at {path} has an unreadable {CONFIG_NAME}: {exc}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"Adapter at {path}: {CONFIG_NAME} is not a JSON object.")
    rank, scaling = check_adapter_config(config, max_rank=max_rank)

    try:
        tensors = load_file(str(weights_file), device="cpu")
    except Exception as exc:  # safetensors raises its own error types for corrupt files
        raise AdapterError(f"Adapter at {path}: cannot read {WEIGHTS_NAME}: {exc}") from None

    halves = {}
    for key, tensor in tensors.items():
        stem = key.removeprefix("base_model.model.")
        for half in ("lora_A", "lora_B"):
            suffix = f".{half}.weight"
            if stem.endswith(suffix):
                halves.setdefault(stem[: -len(suffix)], {})[half] = tensor
                break
        else:
            raise AdapterError(f"Adapter at {path}: unexpected tensor {key!r} (only LoRA A/B weights are served).")

    modules = {}
    for name, pair in halves.items():
        if name not in module_shapes:
            raise AdapterError(f"Adapter at {path}: module {name!r} does not exist in the served model.")
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError(f"Adapter at {path}: module {name!r} lacks its lora_A or lora_B weight.")
        A, B = pair["lora_A"], pair["lora_B"]
        in_features, out_features = module_shapes[name]
        if tuple(A.shape) != (rank, in_features) or tuple(B.shape) != (out_features, rank):
            raise AdapterError(
                f"Adapter at {path}: {name} has A {tuple(A.shape)} / B {tuple(B.shape)}, expected "
                f"({rank}, {in_features}) / ({out_features}, {rank}); was it trained on another base model?"
            )
        modules[name] = (A, B)
    if not modules:
        raise AdapterError(f"Adapter at {path}: {WEIGHTS_NAME} holds no LoRA weights.")
    return AdapterWeights(path=str(directory), rank=rank, scaling=scaling, modules=modules,
                          size_bytes=weights_file.stat().st_size)
