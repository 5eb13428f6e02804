"""The adapter store: PEFT LoRA directories under `ADAPTER_ROOT/<name>/`, written atomically.

A version's directory is flat and named like the version (`u<user>-a<agent>-v<n>`), so the same
string is the directory name, vLLM's `lora_name`, and the key vLLM's filesystem resolver looks up
(`VLLM_LORA_RESOLVER_CACHE_DIR/<lora_name>/`). Only what vLLM can load unchanged is accepted:
`adapter_config.json` + `adapter_model.safetensors`, never a pickle.

Writes go to a hidden staging directory under `ADAPTER_ROOT` (same filesystem), are fsynced,
then renamed into place, so a reader sees either nothing or the whole version.
"""
import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings
from safetensors import safe_open

logger = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# vLLM's --max-lora-rank accepts these values.
ALLOWED_RANKS = frozenset({8, 16, 32, 64})
ALLOWED_TARGETS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"


class AdapterError(Exception):
    """Base class of the adapter store's errors."""


class InvalidAdapterError(AdapterError):
    """The directory is not a PEFT LoRA adapter that vLLM could load unchanged."""


class AdapterIntegrityError(AdapterError):
    """The files on disk do not match the sha256 recorded for the version."""


@dataclass(frozen=True)
class StoredAdapter:
    name: str
    path: Path
    sha256: str
    size_bytes: int


def adapter_root():
    return Path(settings.ADAPTER_ROOT)


def adapter_path(name):
    """Where version `name` lives: `ADAPTER_ROOT/<name>/`."""
    if not name or "/" in name or name.startswith(".") or name in {".", ".."}:
        raise ValueError(f"Invalid adapter name {name!r}.")
    return adapter_root() / name


def read_config(path):
    config_path = Path(path) / CONFIG_FILE
    try:
        return json.loads(config_path.read_text())
    except FileNotFoundError:
        raise InvalidAdapterError(f"{config_path} is missing.") from None
    except json.JSONDecodeError as exc:
        raise InvalidAdapterError(f"{config_path} is not valid JSON: {exc}.") from None


def validate_config(config):
    """Raise InvalidAdapterError unless `config` is a LoRA config vLLM loads unchanged."""
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}, not 'LORA'")
    rank = config.get("r")
    if rank not in ALLOWED_RANKS:
        problems.append(f"rank r={rank!r} is not one of {sorted(ALLOWED_RANKS)}")
    if config.get("bias", "none") != "none":
        problems.append(f"bias is {config.get('bias')!r}, not 'none'")
    if config.get("modules_to_save"):
        problems.append("modules_to_save is set (vLLM does not load them)")
    if config.get("use_dora"):
        problems.append("DoRA (use_dora) is not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        problems.append("per-module rank_pattern/alpha_pattern is not supported")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        problems.append(f"target_modules is a regex ({targets!r}); list module names instead")
    elif not targets:
        problems.append("target_modules is empty")
    else:
        unknown = sorted(set(targets) - ALLOWED_TARGETS)
        if unknown:
            problems.append(f"target_modules {unknown} are not among {sorted(ALLOWED_TARGETS)}")
    if problems:
        raise InvalidAdapterError("Adapter config rejected: " + "; ".join(problems) + ".")


def validate_weights(path):
    """Check the safetensors file opens and holds only LoRA A/B matrices (no DoRA, no extra modules)."""
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        pickled = [p.name for p in Path(path).glob("*.bin")] + [p.name for p in Path(path).glob("*.pt")]
        hint = f" (found {pickled}; pickled weights are never loaded)" if pickled else ""
        raise InvalidAdapterError(f"{weights} is missing{hint}.")
    try:
        with safe_open(str(weights), framework="pt") as handle:
            keys = list(handle.keys())
    except Exception as exc:  # safetensors raises its own error types for a bad header
        raise InvalidAdapterError(f"{weights} is not a readable safetensors file: {exc}.") from None
    bad = [k for k in keys if "lora_A" not in k and "lora_B" not in k]
    if not keys or bad:
        raise InvalidAdapterError(f"{weights} holds tensors other than LoRA A/B: {bad[:5] or 'none at all'}.")


def validate(path):
    """Validate a PEFT directory (config and weights). Returns its config."""
    config = read_config(path)
    validate_config(config)
    validate_weights(path)
    return config


def _files(path):
    path = Path(path)
    return sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())


def directory_sha256(path):
    """sha256 over every file of the directory, in sorted relative-path order.

    Each file contributes its relative path, its size and its bytes, so renaming or moving a
    file changes the digest as surely as flipping a byte does.
    """
    path = Path(path)
    digest = hashlib.sha256()
    for file in _files(path):
        rel = file.relative_to(path).as_posix().encode()
        digest.update(rel + b"\0" + str(file.stat().st_size).encode() + b"\0")
        with open(file, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def directory_size(path):
    return sum(f.stat().st_size for f in _files(path))


def verify(path, sha256):
    """Raise AdapterIntegrityError unless the directory's files hash to `sha256`."""
    path = Path(path)
    if not path.is_dir():
        raise AdapterIntegrityError(f"Adapter directory {path} does not exist; refusing to load it.")
    actual = directory_sha256(path)
    if actual != sha256:
        raise AdapterIntegrityError(
            f"Adapter {path.name} failed its integrity check: files hash to sha256 {actual}, "
            f"but the registry recorded {sha256}. The files were changed or corrupted after "
            "publishing; refusing to load them."
        )


def _fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_file(src, dst):
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
        fout.flush()
        os.fsync(fout.fileno())


def _write_json(dst, data):
    with open(dst, "w") as fout:
        json.dump(data, fout, indent=2, sort_keys=True)
        fout.write("\n")
        fout.flush()
        os.fsync(fout.fileno())


def write_adapter(name, source_dir, *, base_model_name):
    """Copy a PEFT directory into the store as version `name`, atomically.

    Only `adapter_config.json` and `adapter_model.safetensors` are copied; the config's
    `base_model_name_or_path` is set to `base_model_name` (the served model's name), which is what
    vLLM's filesystem resolver compares against.

    Args:
        name: the version's name, `u<user>-a<agent>-v<n>`.
        source_dir: a directory written by `PeftModel.save_pretrained`.
        base_model_name: the served base model's name.

    Returns:
        StoredAdapter with the final path, sha256 and size.

    Raises:
        InvalidAdapterError: the source is not a vLLM-loadable LoRA.
        FileExistsError: a version with that name is already stored (versions are never rewritten).
        OSError: the write failed (disk full...); nothing is left behind.
    """
    source_dir = Path(source_dir)
    config = validate(source_dir)
    final = adapter_path(name)
    if final.exists():
        raise FileExistsError(errno.EEXIST, f"Adapter {name} is already stored; versions are never rewritten", str(final))
    root = adapter_root()
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"{STAGING_PREFIX}{name}-", dir=root))
    try:
        _write_json(staging / CONFIG_FILE, {**config, "base_model_name_or_path": base_model_name})
        _copy_file(source_dir / WEIGHTS_FILE, staging / WEIGHTS_FILE)
        os.chmod(staging, 0o755)
        _fsync_path(staging)
        sha256 = directory_sha256(staging)
        size = directory_size(staging)
        # rename() onto an existing empty directory would succeed silently; check again.
        if final.exists():
            raise FileExistsError(errno.EEXIST, f"Adapter {name} appeared while it was being written", str(final))
        os.rename(staging, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("Stored adapter %s (%d bytes, sha256 %s)", name, size, sha256)
    return StoredAdapter(name=name, path=final, sha256=sha256, size_bytes=size)


def delete_adapter(name):
    """Remove version `name`'s directory: renamed aside first, so no reader sees half of it."""
    final = adapter_path(name)
    if not final.exists():
        return False
    trash = Path(tempfile.mkdtemp(prefix=f"{TRASH_PREFIX}{name}-", dir=adapter_root()))
    os.rename(final, trash / name)
    shutil.rmtree(trash, ignore_errors=True)
    logger.info("Deleted adapter files of %s", name)
    return True


def clean_staging(max_age_s=3600):
    """Remove staging and trash directories left by a crashed process (older than `max_age_s`)."""
    import time

    root = adapter_root()
    removed = []
    if not root.is_dir():
        return removed
    now = time.time()
    for entry in root.iterdir():
        if entry.name.startswith((STAGING_PREFIX, TRASH_PREFIX)) and now - entry.stat().st_mtime > max_age_s:
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed
