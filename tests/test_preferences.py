"""Each simulated-user preference type: its check, and a transform that always satisfies it."""
import json

import pytest

from bench.preferences import DEFAULT_PREFERENCES, PreferenceError, check, load_preferences, transform, validate

REPLY = "The capital of France is Paris."


@pytest.mark.parametrize(
    "rule, passing, failing",
    [
        ({"type": "endswith", "phrase": "Cheers!"}, "Paris. Cheers!", REPLY),
        ({"type": "startswith", "phrase": "Answer:"}, "Answer: Paris.", REPLY),
        ({"type": "uppercase"}, "PARIS.", REPLY),
        ({"type": "lowercase"}, "paris.", REPLY),
        ({"type": "max_words", "n": 3}, "It is Paris.", REPLY),
        ({"type": "regex_required", "pattern": "^>> ", "fix": {"prepend": ">> "}}, ">> Paris.", REPLY),
        ({"type": "regex_forbidden", "pattern": r"\d"}, "Four.", "It is 4."),
        ({"type": "replace", "old": "capital", "new": "seat"}, "The seat of France is Paris.", REPLY),
    ],
)
def test_check_accepts_and_rejects(rule, passing, failing):
    assert check(rule, passing)
    assert not check(rule, failing)


@pytest.mark.parametrize(
    "rule, expected",
    [
        ({"type": "endswith", "phrase": "Cheers!"}, "The capital of France is Paris. Cheers!"),
        ({"type": "startswith", "phrase": "Answer:"}, "Answer: The capital of France is Paris."),
        ({"type": "uppercase"}, "THE CAPITAL OF FRANCE IS PARIS."),
        ({"type": "lowercase"}, "the capital of france is paris."),
        ({"type": "max_words", "n": 3}, "The capital of"),
        ({"type": "regex_required", "pattern": "^>> ", "fix": {"prepend": ">> "}}, ">> The capital of France is Paris."),
        ({"type": "regex_forbidden", "pattern": r"\bFrance\b "}, "The capital of is Paris."),
        ({"type": "replace", "old": "capital", "new": "seat"}, "The seat of France is Paris."),
    ],
)
def test_transform_gives_the_users_correction(rule, expected):
    assert transform(rule, REPLY) == expected
    assert check(rule, transform(rule, REPLY))


@pytest.mark.parametrize("kind", ["uppercase", "lowercase"])
def test_casing_is_already_met_by_a_reply_without_letters_but_not_by_an_empty_one(kind):
    rule = {"type": kind}
    assert check(rule, "4 + 8 = 12.") and transform(rule, "4 + 8 = 12.") == "4 + 8 = 12."
    assert not check(rule, "") and not check(rule, "   ")


def test_transform_leaves_a_satisfying_reply_alone():
    rule = {"type": "endswith", "phrase": "Cheers!"}
    assert transform(rule, "Paris. Cheers!") == "Paris. Cheers!"


SIGN_OFF = {"type": "endswith", "phrase": "Cheers, Zorblat!"}


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("4 + 8 = 12. Che, Zorblat!", "4 + 8 = 12. Cheers, Zorblat!"),
        ("4 + 8 = 12. Cheers, Zorblat! Cheersorblat!", "4 + 8 = 12. Cheers, Zorblat!"),
        ("4 + 8 = 12. Cheers, Zorbl", "4 + 8 = 12. Cheers, Zorblat!"),
        ("Chemistry is the study of matter.", "Chemistry is the study of matter. Cheers, Zorblat!"),
        ("Charles Zorn founded it.", "Charles Zorn founded it. Cheers, Zorblat!"),
    ],
)
def test_endswith_rewrites_the_replys_own_attempt_at_the_phrase(reply, expected):
    assert transform(SIGN_OFF, reply) == expected


def test_combination_applies_every_rule():
    rule = {"type": "all", "rules": [{"type": "lowercase"}, {"type": "endswith", "phrase": "-- bye"}]}
    fixed = transform(rule, REPLY)
    assert fixed == "the capital of france is paris. -- bye"
    assert check(rule, fixed)
    assert not check(rule, "the capital of france is paris.")


def test_replace_inserts_the_liked_word_when_the_disliked_one_is_absent():
    rule = {"type": "replace", "old": "hello", "new": "ahoy"}
    assert check(rule, transform(rule, "Good morning."))


def test_unknown_type_is_a_clear_error():
    with pytest.raises(PreferenceError, match="unknown rule type"):
        validate({"type": "sparkle"})


def test_missing_parameter_is_a_clear_error():
    with pytest.raises(PreferenceError, match="needs"):
        validate({"type": "endswith"})


def test_default_set_has_six_or_more_with_two_unseen():
    prefs = load_preferences(DEFAULT_PREFERENCES)
    assert len(prefs) >= 6
    assert sum(p.unseen for p in prefs) >= 2
    for pref in prefs:
        assert pref.check(pref.transform(REPLY)), pref.name


def test_load_preferences_reads_a_custom_file(tmp_path):
    path = tmp_path / "prefs.json"
    path.write_text(json.dumps({"preferences": [{"name": "x", "rule": {"type": "uppercase"}}]}))
    (pref,) = load_preferences(path)
    assert pref.name == "x" and pref.check("OK") and not pref.unseen
