"""The adapter store: validation, atomic writes, sha256 and its refusal.

`make_peft_dir` writes a real PEFT LoRA directory with `PeftModel.save_pretrained`; the other
serving tests import it.
"""
import errno
import json
import os
from pathlib import Path

import pytest
import torch

from serving import adapters


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def make_peft_dir(dest, *, model_dir=None, seed=1, r=8, target_modules=("q_proj", "v_proj"), **lora_kwargs):
    """Write a real PEFT adapter directory at `dest` with random (non-zero) A and B.

    Args:
        dest: the directory to write.
        model_dir: a Hugging Face model directory to attach it to; default a 1-layer Qwen2.
        seed: torch seed for the LoRA weights, so different seeds give different adapters.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir) if model_dir else _tiny_qwen2()
    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=2 * r, target_modules=list(target_modules), init_lora_weights=False, **lora_kwargs)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    model.save_pretrained(dest, save_embedding_layers=False)
    return Path(dest)


@pytest.fixture(scope="module")
def peft_dir(tmp_path_factory):
    return make_peft_dir(tmp_path_factory.mktemp("peft") / "adapter")


def _copy_with_config(src, dst, **changes):
    dst.mkdir()
    (dst / adapters.WEIGHTS_FILE).write_bytes((src / adapters.WEIGHTS_FILE).read_bytes())
    config = json.loads((src / adapters.CONFIG_FILE).read_text())
    config.update(changes)
    (dst / adapters.CONFIG_FILE).write_text(json.dumps(config))
    return dst


def test_write_adapter_stores_a_flat_directory_named_for_the_version(peft_dir, settings):
    stored = adapters.write_adapter("u1-a2-v1", peft_dir, base_model_name="base")
    assert stored.path == settings.ADAPTER_ROOT / "u1-a2-v1"
    assert sorted(p.name for p in stored.path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert stored.sha256 == adapters.directory_sha256(stored.path)
    assert stored.size_bytes == adapters.directory_size(stored.path)


def test_write_adapter_sets_base_model_name_to_the_served_name(peft_dir):
    stored = adapters.write_adapter("u1-a2-v1", peft_dir, base_model_name="served-base")
    assert adapters.read_config(stored.path)["base_model_name_or_path"] == "served-base"


def test_stored_adapter_loads_back_with_peft(peft_dir):
    from peft import PeftModel

    stored = adapters.write_adapter("u1-a2-v1", peft_dir, base_model_name="base")
    model = PeftModel.from_pretrained(_tiny_qwen2(), str(stored.path))
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_write_adapter_never_overwrites_a_version(peft_dir):
    adapters.write_adapter("u1-a2-v1", peft_dir, base_model_name="base")
    with pytest.raises(FileExistsError):
        adapters.write_adapter("u1-a2-v1", peft_dir, base_model_name="base")


def test_write_adapter_cleans_its_staging_dir_when_the_disk_is_full(peft_dir, settings, monkeypatch):
    def disk_full(src, dst):
        with open(dst, "wb") as handle:
            handle.write(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(adapters, "_copy_file", disk_full)
    with pytest.raises(OSError) as excinfo:
        adapters.write_adapter("u1-a2-v1", peft_dir, base_model_name="base")
    assert excinfo.value.errno == errno.ENOSPC
    assert list(settings.ADAPTER_ROOT.iterdir()) == []


def test_sha256_is_deterministic_and_covers_every_byte(peft_dir, tmp_path):
    first = adapters.directory_sha256(peft_dir)
    assert adapters.directory_sha256(peft_dir) == first
    copy = _copy_with_config(peft_dir, tmp_path / "copy")
    weights = copy / adapters.WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    before = adapters.directory_sha256(copy)
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    assert adapters.directory_sha256(copy) != before


def test_verify_refuses_a_flipped_byte_with_a_clear_message(peft_dir):
    stored = adapters.write_adapter("u1-a2-v1", peft_dir, base_model_name="base")
    adapters.verify(stored.path, stored.sha256)
    weights = stored.path / adapters.WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(adapters.AdapterIntegrityError, match=r"u1-a2-v1 failed its integrity check.*refusing"):
        adapters.verify(stored.path, stored.sha256)


def test_verify_refuses_a_missing_directory(settings):
    with pytest.raises(adapters.AdapterIntegrityError, match="does not exist"):
        adapters.verify(settings.ADAPTER_ROOT / "u1-a2-v9", "0" * 64)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"r": 4}, "rank r=4"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"use_dora": True}, "DoRA"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
        ({"target_modules": ".*proj"}, "regex"),
        ({"peft_type": "IA3"}, "peft_type"),
    ],
)
def test_write_adapter_rejects_configs_vllm_cannot_load(peft_dir, tmp_path, settings, changes, message):
    source = _copy_with_config(peft_dir, tmp_path / "bad", **changes)
    with pytest.raises(adapters.InvalidAdapterError, match=message):
        adapters.write_adapter("u1-a2-v1", source, base_model_name="base")
    assert list(settings.ADAPTER_ROOT.iterdir()) == []


def test_write_adapter_refuses_pickled_weights(peft_dir, tmp_path):
    source = _copy_with_config(peft_dir, tmp_path / "pickled")
    os.rename(source / adapters.WEIGHTS_FILE, source / "adapter_model.bin")
    with pytest.raises(adapters.InvalidAdapterError, match="pickled weights are never loaded"):
        adapters.write_adapter("u1-a2-v1", source, base_model_name="base")


def test_write_adapter_refuses_dora_weights(tmp_path):
    source = make_peft_dir(tmp_path / "dora", use_dora=True)
    config = json.loads((source / adapters.CONFIG_FILE).read_text())
    (source / adapters.CONFIG_FILE).write_text(json.dumps({**config, "use_dora": False}))
    with pytest.raises(adapters.InvalidAdapterError, match="other than LoRA A/B"):
        adapters.write_adapter("u1-a2-v1", source, base_model_name="base")


def test_delete_adapter_removes_the_directory(peft_dir, settings):
    adapters.write_adapter("u1-a2-v1", peft_dir, base_model_name="base")
    assert adapters.delete_adapter("u1-a2-v1") is True
    assert list(settings.ADAPTER_ROOT.iterdir()) == []
    assert adapters.delete_adapter("u1-a2-v1") is False


def test_adapter_path_rejects_names_that_escape_the_root():
    for name in ["../etc", "a/b", ".staging-x", ""]:
        with pytest.raises(ValueError):
            adapters.adapter_path(name)
