"""The offline demo model: deterministic, cached, ChatML, and judged independently of style."""
import hashlib
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.demo_model import DemoModelConfig, build_demo_model, is_built
from serving.demo_model.corpus import (
    HINT_MARKER, STYLES, heldout_questions, is_correct, training_questions, training_dialogues, with_hint,
)


def _sha256(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _generate(model_dir, messages, max_new_tokens=48):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tok, out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.slow
def test_two_builds_of_one_config_give_identical_weights(tmp_path, tiny_model_dir):
    again = build_demo_model(tmp_path / "again", DemoModelConfig.tiny(), progress=False)
    assert _sha256(again / "model.safetensors") == _sha256(tiny_model_dir / "model.safetensors")
    assert _sha256(again / "tokenizer.json") == _sha256(tiny_model_dir / "tokenizer.json")


def test_second_build_call_returns_cached_dir_without_rebuilding(tiny_model_dir):
    before = (tiny_model_dir / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert build_demo_model(tiny_model_dir, DemoModelConfig.tiny(), progress=False) == tiny_model_dir
    assert time.monotonic() - started < 1.0
    assert (tiny_model_dir / "model.safetensors").stat().st_mtime_ns == before


def test_a_different_config_is_not_taken_for_the_cached_build(tiny_model_dir):
    assert is_built(tiny_model_dir, DemoModelConfig.tiny())
    assert not is_built(tiny_model_dir, DemoModelConfig())


def test_fingerprint_depends_on_config():
    assert DemoModelConfig.tiny().fingerprint() == DemoModelConfig.tiny().fingerprint()
    assert DemoModelConfig.tiny().fingerprint() != DemoModelConfig().fingerprint()


def test_chat_template_renders_chatml_and_round_trips(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": with_hint("What is 12 + 30? Ünïcode ☃ ok", "Reply in all caps.")}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nYou are terse.<|im_end|>\n"
                    f"<|im_start|>user\n{messages[1]['content']}<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


def test_im_end_is_eos_in_tokenizer_model_and_generation_config(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert model.config.eos_token_id == im_end == model.generation_config.eos_token_id
    assert model.config.model_type == "qwen2"


def test_model_has_the_lora_target_projections(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    assert {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"} <= names


def test_tiny_model_generation_terminates_with_eos(tiny_model_dir):
    tok, ids = _generate(tiny_model_dir, [{"role": "user", "content": "What is the capital of France?"}])
    assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")


def test_unseen_words_split_into_subwords_not_bytes(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # Not in the dialogue corpus; general English in the BPE training gives it multi-byte pieces.
    pieces = tok.tokenize(" information")
    assert len(pieces) < len(" information")


def test_with_hint_uses_openclaw_marker():
    assert HINT_MARKER == "[user's hint / instruction]"
    assert with_hint("What is 2 + 2?", " Be terse. ") == "What is 2 + 2?\n\n[user's hint / instruction]\nBe terse."


@pytest.mark.parametrize("style", sorted(STYLES))
def test_is_correct_accepts_every_style_of_a_right_answer(style):
    s = STYLES[style]
    for qa in {q.category: q for q in heldout_questions(100)}.values():
        reply = s.render(qa, s.params[0])
        assert is_correct(qa, reply)
        assert s.follows(reply, s.params[0])


@pytest.mark.parametrize("style", sorted(STYLES))
def test_the_plain_answer_does_not_count_as_following_a_style(style):
    s = STYLES[style]
    for qa in {q.category: q for q in heldout_questions(100)}.values():
        # Sums have no letters and conversions no capitals: case styles are vacuous on them.
        vacuous = (qa.category, style) in {("arithmetic", "uppercase"), ("arithmetic", "lowercase"), ("unit", "lowercase")}
        if not vacuous and (qa.category != "small_talk" or style not in ("terse", "casual")):
            assert not s.follows(qa.answer, s.params[0]), qa


def test_is_correct_rejects_a_wrong_answer():
    qa = next(q for q in heldout_questions(100) if q.category == "capital")
    wrong = qa.answer.replace(qa.keywords[0], "Atlantis")
    assert not is_correct(qa, wrong)
    assert is_correct(qa, "ANSWER: " + qa.answer.upper() + "\n- Ada")


def test_heldout_questions_never_appear_in_training():
    trained = {qa.question for qa in training_questions()}
    held = heldout_questions(200)
    assert len({q.question for q in held}) == 200
    assert not trained & {q.question for q in held}
    assert {q.category for q in held} == {"capital", "definition", "shell", "small_talk", "arithmetic", "unit"}


def test_training_dialogues_are_deterministic_and_use_both_style_channels():
    a, b = training_dialogues(300, seed=3), training_dialogues(300, seed=3)
    assert [d.messages for d in a] == [d.messages for d in b]
    users = [m["content"] for d in a for m in d.messages if m["role"] == "user"]
    assert any(HINT_MARKER in u for u in users)
    assert any(m["role"] == "system" and "caps" in m["content"] for d in a for m in d.messages)
