"""Simulated users' hidden preferences: a check on a reply and the correction the user would write.

A preference file is JSON: {"preferences": [{"name": ..., "rule": RULE, "unseen": bool}, ...]}.
A RULE is one of (docs/benchmarks/personalization_format.md):

    {"type": "endswith", "phrase": "Cheers, Zorblat!"}
    {"type": "startswith", "phrase": "Answer:"}
    {"type": "uppercase"} / {"type": "lowercase"}
    {"type": "max_words", "n": 5}
    {"type": "regex_required", "pattern": "...", "fix": {"prepend": "..."} | {"append": "..."}}
    {"type": "regex_forbidden", "pattern": "...", "replacement": ""}
    {"type": "replace", "old": "hello", "new": "ahoy"}
    {"type": "all", "rules": [RULE, ...]}
"""
import json
import re
from difflib import SequenceMatcher
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PREFERENCES = Path(__file__).with_name("preferences.json")


class PreferenceError(ValueError):
    pass


def _check_endswith(rule, reply):
    return reply.rstrip().endswith(rule["phrase"])


# A user fixing their sign-off rewrites a reply's own attempt at it ("… Che, Zorblat!", or the
# phrase followed by more text) rather than appending the phrase after it: an appended copy would
# teach the model to write the garble and then the phrase. An attempt is the earliest later word
# that starts like the phrase and whose next len(phrase) characters are at least this similar to
# it, or a tail that is the phrase's own beginning ("… Cheers, Zorbl").
SIGN_OFF_SIMILARITY = 0.6


def _sign_off_attempt(phrase, reply):
    """Where the reply's attempt at the phrase starts, or None."""
    for word in re.finditer(r"(?<=\s)\S", reply):
        tail = reply[word.start():]
        if phrase.startswith(tail.rstrip()):
            return word.start()
        if tail[0] == phrase[0] and SequenceMatcher(None, tail[: len(phrase)], phrase).ratio() >= SIGN_OFF_SIMILARITY:
            return word.start()
    return None


def _fix_endswith(rule, reply):
    if _check_endswith(rule, reply):
        return reply
    attempt = _sign_off_attempt(rule["phrase"], reply)
    kept = reply if attempt is None else reply[:attempt]
    return f"{kept.rstrip()} {rule['phrase']}"


def _check_startswith(rule, reply):
    return reply.lstrip().startswith(rule["phrase"])


def _fix_startswith(rule, reply):
    return reply if _check_startswith(rule, reply) else f"{rule['phrase']} {reply.lstrip()}"


# A reply with no letters at all ("4 + 8 = 12.") already has the casing a user asks for: there is
# nothing to correct. An empty reply never passes.


def _check_uppercase(rule, reply):
    return bool(reply.strip()) and reply == reply.upper()


def _check_lowercase(rule, reply):
    return bool(reply.strip()) and reply == reply.lower()


def _check_max_words(rule, reply):
    return 0 < len(reply.split()) <= rule["n"]


def _fix_max_words(rule, reply):
    return " ".join(reply.split()[: rule["n"]])


def _check_regex_required(rule, reply):
    return re.search(rule["pattern"], reply) is not None


def _fix_regex_required(rule, reply):
    if _check_regex_required(rule, reply):
        return reply
    fix = rule["fix"]
    fixed = f"{fix['prepend']}{reply}" if "prepend" in fix else f"{reply}{fix['append']}"
    if not _check_regex_required(rule, fixed):
        raise PreferenceError(f"fix {fix!r} does not satisfy pattern {rule['pattern']!r}")
    return fixed


def _check_regex_forbidden(rule, reply):
    return re.search(rule["pattern"], reply) is None


def _fix_regex_forbidden(rule, reply):
    fixed = re.sub(rule["pattern"], rule.get("replacement", ""), reply)
    return re.sub(r"  +", " ", fixed).strip()


def _word(rule_word):
    return re.compile(rf"\b{re.escape(rule_word)}\b", re.IGNORECASE)


def _check_replace(rule, reply):
    return _word(rule["old"]).search(reply) is None and _word(rule["new"]).search(reply) is not None


def _fix_replace(rule, reply):
    if _word(rule["old"]).search(reply):
        return _word(rule["old"]).sub(rule["new"], reply)
    return reply if _word(rule["new"]).search(reply) else f"{rule['new'].capitalize()}! {reply}"


def _check_all(rule, reply):
    return all(check(sub, reply) for sub in rule["rules"])


def _fix_all(rule, reply):
    for sub in rule["rules"]:
        reply = transform(sub, reply)
    return reply


_RULES = {
    "endswith": (_check_endswith, _fix_endswith, ("phrase",)),
    "startswith": (_check_startswith, _fix_startswith, ("phrase",)),
    "uppercase": (_check_uppercase, lambda rule, reply: reply.upper(), ()),
    "lowercase": (_check_lowercase, lambda rule, reply: reply.lower(), ()),
    "max_words": (_check_max_words, _fix_max_words, ("n",)),
    "regex_required": (_check_regex_required, _fix_regex_required, ("pattern", "fix")),
    "regex_forbidden": (_check_regex_forbidden, _fix_regex_forbidden, ("pattern",)),
    "replace": (_check_replace, _fix_replace, ("old", "new")),
    "all": (_check_all, _fix_all, ("rules",)),
}


def validate(rule):
    if not isinstance(rule, dict) or rule.get("type") not in _RULES:
        raise PreferenceError(f"unknown rule type in {rule!r}; known: {sorted(_RULES)}")
    missing = [key for key in _RULES[rule["type"]][2] if key not in rule]
    if missing:
        raise PreferenceError(f"rule {rule['type']!r} needs {missing}")
    if rule["type"] == "all":
        for sub in rule["rules"]:
            validate(sub)
    for key in ("pattern",):
        if key in rule:
            re.compile(rule[key])


def check(rule, reply):
    """True when the reply satisfies the rule."""
    return _RULES[rule["type"]][0](rule, reply)


def transform(rule, reply):
    """The corrected reply the user would write; it always satisfies the rule."""
    return _RULES[rule["type"]][1](rule, reply)


@dataclass(frozen=True)
class Preference:
    name: str
    rule: dict
    unseen: bool = False  # the demo model's pretraining never showed this style
    description: str = ""

    def check(self, reply):
        return check(self.rule, reply)

    def transform(self, reply):
        return transform(self.rule, reply)


def load_preferences(path=DEFAULT_PREFERENCES):
    data = json.loads(Path(path).read_text())
    prefs = []
    for item in data["preferences"]:
        validate(item["rule"])
        prefs.append(Preference(item["name"], item["rule"], item.get("unseen", False), item.get("description", "")))
    return prefs
