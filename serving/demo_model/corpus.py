"""A deterministic synthetic dialogue corpus for the offline demo model.

Facts (capitals, definitions, shell commands, small talk) come from built-in tables, numbers from
arithmetic and unit conversions. Every answer also exists in several *styles* (uppercase, a
sign-off, terse...), requested in the system prompt or as an OpenClaw-RL hindsight hint appended
to the user message, so that a LoRA adapter can later learn a user's preferred style.

Held-out questions are never in the training data: power-of-ten conversions hold out values (the
model must generalise "append zeros"); everything else holds out one question wording per item,
so a held-out question pairs a known fact with a wording learned on other facts (a 4M-parameter
model trained for minutes does not learn to add unseen operand pairs: 0.10 when we tried).
"""
from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

# OpenClaw-RL appends a hindsight hint to the last user message under this marker
# (openclaw-opd `_append_hint_to_messages`: content + "\n\n[user's hint / instruction]\n" + hint).
HINT_MARKER = "[user's hint / instruction]"


def with_hint(user_text: str, hint: str) -> str:
    """Append `hint` to a user message exactly as OpenClaw-RL does for its OPD teacher."""
    return f"{user_text}\n\n{HINT_MARKER}\n{hint.strip()}".strip()


@dataclass(frozen=True)
class QA:
    """One question with its canonical reply and the content a correct reply must contain."""

    question: str
    answer: str  # canonical reply, plain style
    keywords: tuple[str, ...]  # all must appear (case-insensitive, whole words)
    short: str = ""  # the terse form of the answer
    category: str = ""


# ---------------------------------------------------------------------------------------------
# Built-in tables
# ---------------------------------------------------------------------------------------------

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Japan": "Tokyo", "China": "Beijing", "India": "New Delhi",
    "Canada": "Ottawa", "Australia": "Canberra", "Brazil": "Brasilia", "Argentina": "Buenos Aires",
    "Mexico": "Mexico City", "Egypt": "Cairo", "Kenya": "Nairobi", "Nigeria": "Abuja",
    "Russia": "Moscow", "Poland": "Warsaw", "Sweden": "Stockholm", "Norway": "Oslo",
    "Finland": "Helsinki", "Denmark": "Copenhagen", "Ireland": "Dublin", "Greece": "Athens",
    "Turkey": "Ankara", "Austria": "Vienna", "Belgium": "Brussels", "Netherlands": "Amsterdam",
    "Switzerland": "Bern", "Hungary": "Budapest", "Czechia": "Prague", "Romania": "Bucharest",
    "Ukraine": "Kyiv", "Peru": "Lima", "Chile": "Santiago", "Colombia": "Bogota",
    "Cuba": "Havana", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Indonesia": "Jakarta",
    "South Korea": "Seoul", "Iran": "Tehran", "Iraq": "Baghdad", "Israel": "Jerusalem",
    "Morocco": "Rabat", "Ethiopia": "Addis Ababa", "Ghana": "Accra", "Iceland": "Reykjavik",
    "New Zealand": "Wellington", "Pakistan": "Islamabad", "Philippines": "Manila",
    "Scotland": "Edinburgh", "England": "London", "Wales": "Cardiff", "Venezuela": "Caracas",
    "Bolivia": "Sucre", "Uruguay": "Montevideo", "Nepal": "Kathmandu", "Mongolia": "Ulaanbaatar",
    "Croatia": "Zagreb",
}

# word -> (definition, keywords a correct reply must contain)
DEFINITIONS = {
    "photosynthesis": ("the process by which plants turn sunlight, water and carbon dioxide into sugar", ("plants", "sunlight")),
    "gravity": ("the force that pulls objects with mass toward each other", ("force", "mass")),
    "democracy": ("a system of government in which the people choose their leaders by voting", ("government", "people")),
    "algorithm": ("a finite list of steps that solves a problem", ("steps", "problem")),
    "volcano": ("an opening in the earth's crust through which lava and gas escape", ("lava",)),
    "molecule": ("a group of atoms bonded together", ("atoms",)),
    "metaphor": ("a figure of speech that describes one thing as if it were another", ("figure of speech",)),
    "inflation": ("a general rise in prices over time", ("prices",)),
    "ecosystem": ("a community of living things and their environment", ("living things", "environment")),
    "compiler": ("a program that translates source code into machine code", ("source code", "machine code")),
    "database": ("an organized collection of data that can be searched and updated", ("data",)),
    "planet": ("a large body that orbits a star", ("orbits", "star")),
    "virus": ("a tiny agent that can only reproduce inside the cells of a host", ("cells", "host")),
    "recipe": ("a set of instructions for preparing a dish", ("instructions", "dish")),
    "glacier": ("a large, slow moving mass of ice", ("ice",)),
    "atom": ("the smallest unit of a chemical element", ("smallest", "element")),
    "synonym": ("a word that means the same as another word", ("same",)),
    "antonym": ("a word that means the opposite of another word", ("opposite",)),
    "battery": ("a device that stores chemical energy and releases it as electricity", ("energy", "electricity")),
    "vaccine": ("a substance that trains the immune system to fight a disease", ("immune system",)),
    "economy": ("the system of producing, selling and buying goods and services", ("goods", "services")),
    "thermometer": ("an instrument that measures temperature", ("temperature",)),
    "telescope": ("an instrument that makes distant objects look closer", ("distant",)),
    "haiku": ("a short poem with three lines of five, seven and five syllables", ("poem", "three lines")),
    "password": ("a secret word used to prove who you are", ("secret",)),
    "encryption": ("the process of encoding data so only authorized people can read it", ("encoding",)),
    "circle": ("a round shape whose points are all the same distance from the center", ("round", "center")),
    "triangle": ("a shape with three sides and three angles", ("three sides",)),
    "mammal": ("a warm blooded animal that feeds its young with milk", ("animal", "milk")),
    "desert": ("a dry region that gets very little rain", ("dry", "rain")),
    "river": ("a large natural stream of water flowing to the sea", ("water",)),
    "island": ("a piece of land surrounded by water", ("land", "water")),
    "bicycle": ("a vehicle with two wheels that you pedal", ("two wheels",)),
    "library": ("a place where books are kept for people to read or borrow", ("books",)),
    "orchestra": ("a large group of musicians playing together", ("musicians",)),
    "protein": ("a nutrient made of amino acids that builds muscle", ("amino acids",)),
    "calendar": ("a system for organizing days, weeks and months", ("days",)),
    "harbor": ("a sheltered place where ships can stay safely", ("ships",)),
    "oxygen": ("a gas in the air that animals need to breathe", ("gas", "breathe")),
    "friction": ("the force that resists motion between two surfaces", ("force", "surfaces")),
}

# task -> (command, keywords)
SHELL = {
    "list the files in a directory": ("ls", ("ls",)),
    "show hidden files": ("ls -a", ("ls -a",)),
    "print the current directory": ("pwd", ("pwd",)),
    "change to another directory": ("cd", ("cd",)),
    "make a new directory": ("mkdir", ("mkdir",)),
    "remove an empty directory": ("rmdir", ("rmdir",)),
    "delete a file": ("rm", ("rm",)),
    "copy a file": ("cp", ("cp",)),
    "move or rename a file": ("mv", ("mv",)),
    "show the contents of a file": ("cat", ("cat",)),
    "search for text in files": ("grep", ("grep",)),
    "find files by name": ("find . -name", ("find",)),
    "see the first lines of a file": ("head", ("head",)),
    "see the last lines of a file": ("tail", ("tail",)),
    "follow a log file as it grows": ("tail -f", ("tail -f",)),
    "count the lines in a file": ("wc -l", ("wc -l",)),
    "check disk usage of a folder": ("du -sh", ("du",)),
    "check free disk space": ("df -h", ("df",)),
    "see running processes": ("ps aux", ("ps",)),
    "stop a process by its id": ("kill", ("kill",)),
    "change file permissions": ("chmod", ("chmod",)),
    "change the owner of a file": ("chown", ("chown",)),
    "create an empty file": ("touch", ("touch",)),
    "download a file from a url": ("curl -O", ("curl",)),
    "extract a tar archive": ("tar -xf", ("tar",)),
    "sort the lines of a file": ("sort", ("sort",)),
    "remove duplicate lines": ("sort -u", ("sort -u",)),
    "show the command history": ("history", ("history",)),
    "check the system uptime": ("uptime", ("uptime",)),
    "see who is logged in": ("who", ("who",)),
}

# intent -> (user wordings, canonical reply, keywords)
SMALL_TALK = {
    "greeting": (["Hello!", "Hi there.", "Hey, how are you?", "Good morning!", "Hi!"],
                 "Hello! How can I help you today?", ("hello", "help")),
    "thanks": (["Thanks!", "Thank you so much.", "Thanks for the help.", "Much appreciated, thanks."],
               "You're welcome! Happy to help.", ("welcome",)),
    "bye": (["Bye!", "Goodbye.", "See you later.", "I have to go now, bye."],
            "Goodbye! Have a great day.", ("goodbye",)),
    "name": (["What is your name?", "Who are you?", "What should I call you?"],
             "I am Claw, a small demo assistant.", ("claw",)),
    "joke": (["Tell me a joke.", "Do you know any jokes?", "Make me laugh."],
             "Why did the computer go to the doctor? It had a virus.", ("virus",)),
    "mood": (["How are you doing?", "How is your day going?", "Are you doing well?"],
             "I am doing well, thank you for asking.", ("well",)),
    "ability": (["What can you do?", "How can you help me?", "What are you good at?"],
                "I can answer questions about arithmetic, units, capitals, words and shell commands.", ("questions",)),
}
# Held-out wordings for small talk (never trained).
SMALL_TALK_HELDOUT = {
    "greeting": ["Hello, nice to meet you!"],
    "thanks": ["Thank you, that was useful."],
    "bye": ["Goodbye, talk to you soon."],
    "name": ["Please tell me your name."],
    "joke": ["Could you tell me a funny joke?"],
    "mood": ["How are you today?"],
    "ability": ["What kinds of things can you do?"],
}

UNITS = [  # (from singular, from plural, to plural, factor, max n, exact table: hold out wordings)
    ("meter", "meters", "centimeters", 100, 99, False),
    ("kilometer", "kilometers", "meters", 1000, 99, False),
    ("kilogram", "kilograms", "grams", 1000, 99, False),
    ("liter", "liters", "milliliters", 1000, 99, False),
    ("dollar", "dollars", "cents", 100, 99, False),
    ("hour", "hours", "minutes", 60, 12, True),
    ("minute", "minutes", "seconds", 60, 12, True),
    ("foot", "feet", "inches", 12, 12, True),
    ("day", "days", "hours", 24, 10, True),
    ("week", "weeks", "days", 7, 12, True),
]

# Question wordings; each item has one of them held out (see `_split`).
TEMPLATES = {
    "capital": ["What is the capital of {x}?", "What's the capital city of {x}?", "Name the capital of {x}.",
                "capital of {x}?", "Which city is the capital of {x}?", "Tell me the capital of {x}.",
                "Do you know the capital of {x}?"],
    "definition": ["What is {a} {x}?", "Define {x}.", "What does {x} mean?", "Explain what {a} {x} is.",
                   "definition of {x}?", "Can you tell me what {x} means?", "Give me the meaning of {x}."],
    "shell": ["How do I {x}?", "Which command can I use to {x}?", "What's the shell command to {x}?",
              "In the terminal, how do I {x}?", "linux: how to {x}?", "I want to {x} in bash. How?"],
    "add": ["What is {a} + {b}?", "What is {a} plus {b}?", "Compute {a} + {b}.", "{a} + {b} = ?",
            "How much is {a} plus {b}?", "Add {a} and {b}."],
    "sub": ["What is {a} - {b}?", "What is {a} minus {b}?", "Compute {a} - {b}.", "{a} - {b} = ?",
            "How much is {a} minus {b}?", "Subtract {b} from {a}."],
    "mul": ["What is {a} * {b}?", "What is {a} times {b}?", "Compute {a} x {b}.", "{a} * {b} = ?",
            "How much is {a} times {b}?", "Multiply {a} by {b}."],
    "unit": ["How many {to} are in {n} {frm}?", "Convert {n} {frm} to {to}.", "What is {n} {frm} in {to}?",
             "{n} {frm} in {to}?", "How many {to} is {n} {frm}?", "Please convert {n} {frm} into {to}."],
}


def _held_out_item(*key) -> bool:
    """A stable 1-in-8 split of operand pairs (crc32, not hash(), so it survives restarts)."""
    return zlib.crc32(repr(key).encode()) % 8 == 0


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# ---------------------------------------------------------------------------------------------
# Question generators: each yields (QA, heldout) for every (item, wording) combination
# ---------------------------------------------------------------------------------------------


def _split(templates: list[str], idx: int, item_heldout: bool | None, key) -> bool:
    """Whether (item, wording idx) is held out: by item where given, else one wording per item.

    Each item loses a different wording, so every wording is still trained on other items and a
    held-out question is a new (item, wording) combination.
    """
    if item_heldout is not None:
        return item_heldout
    return idx == zlib.crc32(repr(key).encode()) % len(templates)


def _capital_qas():
    tpls = TEMPLATES["capital"]
    for country, city in CAPITALS.items():
        for i, t in enumerate(tpls):
            qa = QA(t.format(x=country), f"The capital of {country} is {city}.", (city,), city, "capital")
            yield qa, _split(tpls, i, None, country)


def _definition_qas():
    tpls = TEMPLATES["definition"]
    for word, (meaning, kws) in DEFINITIONS.items():
        answer = f"{word.capitalize()} is {meaning}."
        for i, t in enumerate(tpls):
            qa = QA(t.format(x=word, a=_article(word)), answer, kws, meaning.capitalize() + ".", "definition")
            yield qa, _split(tpls, i, None, word)


def _shell_qas():
    tpls = TEMPLATES["shell"]
    for task, (cmd, kws) in SHELL.items():
        for i, t in enumerate(tpls):
            qa = QA(t.format(x=task), f"Use `{cmd}` to {task}.", kws, f"`{cmd}`", "shell")
            yield qa, _split(tpls, i, None, task)


def _small_talk_qas():
    for intent, (wordings, reply, kws) in SMALL_TALK.items():
        for w in wordings:
            yield QA(w, reply, kws, reply.split(".")[0].split("!")[0] + ".", "small_talk"), False
        for w in SMALL_TALK_HELDOUT[intent]:
            yield QA(w, reply, kws, reply.split(".")[0].split("!")[0] + ".", "small_talk"), True


def _arithmetic_qas():
    ops = {"add": ("+", range(0, 21), lambda a, b: a + b),
           "sub": ("-", range(0, 21), lambda a, b: a - b),
           "mul": ("*", range(0, 13), lambda a, b: a * b)}
    for op, (sym, rng, fn) in ops.items():
        for a in rng:
            for b in rng:
                if op == "sub" and b > a:
                    continue
                c = fn(a, b)
                for i, t in enumerate(TEMPLATES[op]):
                    qa = QA(t.format(a=a, b=b), f"{a} {sym} {b} = {c}.", (str(c),), str(c), "arithmetic")
                    yield qa, _split(TEMPLATES[op], i, None, (op, a, b))


def _unit_qas():
    tpls = TEMPLATES["unit"]
    for one, many, to, factor, max_n, exact in UNITS:
        for n in range(1, max_n + 1):
            frm = one if n == 1 else many
            m = n * factor
            held = None if exact else _held_out_item(one, n)
            for i, t in enumerate(tpls):
                qa = QA(t.format(n=n, frm=frm, to=to), f"{n} {frm} is {m} {to}.", (str(m), to), f"{m} {to}.", "unit")
                yield qa, _split(tpls, i, held, (one, n))


GENERATORS = {
    "capital": _capital_qas, "definition": _definition_qas, "shell": _shell_qas,
    "small_talk": _small_talk_qas, "arithmetic": _arithmetic_qas, "unit": _unit_qas,
}
# Sampling weight of each category in training dialogues and in held-out questions.
CATEGORY_WEIGHTS = {"capital": 3, "definition": 3, "shell": 3, "small_talk": 1, "arithmetic": 3, "unit": 2}


def _pool(heldout: bool) -> dict[str, list[QA]]:
    return {name: [qa for qa, h in gen() if h == heldout] for name, gen in GENERATORS.items()}


def _sample_qa(pools: dict[str, list[QA]], rng: random.Random) -> QA:
    names = sorted(pools)
    cat = rng.choices(names, weights=[CATEGORY_WEIGHTS[n] for n in names])[0]
    return rng.choice(pools[cat])


def training_questions() -> list[QA]:
    """Every question wording that may appear in training dialogues."""
    return [qa for qas in _pool(False).values() for qa in qas]


def question_stream(seed: int, heldout: bool = False) -> Iterator[QA]:
    """Endless questions drawn with the category mix of training dialogues and held-out
    questions (CATEGORY_WEIGHTS), not the raw pool's (90% arithmetic and units); deterministic."""
    rng = random.Random(seed)
    pools = _pool(heldout)
    while True:
        yield _sample_qa(pools, rng)


def heldout_questions(n: int = 100, seed: int = 1234) -> list[QA]:
    """`n` distinct questions never seen in training, mixed over categories (deterministic)."""
    rng = random.Random(seed)
    pools = _pool(True)
    seen: dict[str, QA] = {}
    while len(seen) < n:
        qa = _sample_qa(pools, rng)
        seen.setdefault(qa.question, qa)
    return list(seen.values())


# ---------------------------------------------------------------------------------------------
# Styles
# ---------------------------------------------------------------------------------------------


def _sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+", text.strip())
    return [p for p in parts if p]


@dataclass(frozen=True)
class Style:
    """A way of rendering any answer, with wordings a user might use to ask for it."""

    name: str
    render: Callable[[QA, str], str]  # (qa, param) -> styled reply
    follows: Callable[[str, str], bool]  # (reply, param) -> whether the reply has this style
    instructions: tuple[str, ...]  # wordings asking for the style; "{p}" is the parameter
    params: tuple[str, ...] = ("",)  # parameters seen in training (sign-off texts, prefixes)

    def instruction(self, rng: random.Random, param: str) -> str:
        return rng.choice(self.instructions).format(p=param)


def _is_terse(reply: str) -> bool:
    # The full answers are sentences ("X is Y", "a + b = c", "Use `cmd` to ..."); terse ones are not.
    r = reply.strip()
    return ("\n" not in r and len(r.split()) <= 14 and "=" not in r
            and not re.search(r"\b(is|are)\b", r.lower()) and not r.lower().startswith("use "))


STYLES: dict[str, Style] = {s.name: s for s in [
    Style("uppercase", lambda qa, p: qa.answer.upper(),
          lambda r, p: r == r.upper(),  # vacuously true without letters
          ("Reply in all caps.", "Always answer in uppercase letters.", "WRITE EVERYTHING IN CAPITAL LETTERS.",
           "The user wants every reply in upper case.", "Use only capital letters in your answers.",
           "Please shout: answer in all caps.")),
    Style("lowercase", lambda qa, p: qa.answer.lower(),
          lambda r, p: r == r.lower(),
          ("Reply in all lowercase.", "never use capital letters.", "The user prefers answers written entirely in lowercase.",
           "Write your replies in lower case only.", "no capitals please, lowercase everything.")),
    Style("terse", lambda qa, p: qa.short, lambda r, p: _is_terse(r),
          ("Be terse: give only the answer.", "Answer with as few words as possible.",
           "The user wants short replies, just the answer and nothing else.", "No full sentences, only the result.",
           "Keep it extremely brief.")),
    Style("signoff", lambda qa, p: f"{qa.answer}\n{p}",
          lambda r, p: r.rstrip().endswith(p.strip()),
          ("End every reply with \"{p}\".", "Always sign off with: {p}", "Finish each answer with the line \"{p}\".",
           "The user wants every reply to end with {p}", "Close your replies with \"{p}\"."),
          ("- Ada", "Best, Sam", "Regards, the assistant", "Have a nice day!", "Yours, Robo", "Peace out.",
           "-- Claw", "Kind regards, Lee", "Ciao!", "Over and out.")),
    Style("prefix", lambda qa, p: f"{p} {qa.answer}",
          lambda r, p: r.lstrip().startswith(p.strip()),
          ("Start every reply with \"{p}\".", "Begin each answer with {p}", "Always open your reply with the word {p}",
           "The user wants replies to start with \"{p}\".", "Prefix your answers with \"{p}\"."),
          ("Answer:", "Sure!", "Okay.", ">>", "Result:", "Well,", "Hmm.", "Note:", "Reply:", "Yes.")),
    Style("formal", lambda qa, p: f"Certainly. {qa.answer} Please let me know if I may assist further.",
          lambda r, p: r.lstrip().lower().startswith("certainly"),
          ("Use a formal, polite tone.", "Be formal and courteous.", "The user prefers a professional, formal register.",
           "Answer formally, like a butler.")),
    Style("casual", lambda qa, p: f"Sure thing! {qa.answer} :)",
          lambda r, p: "sure thing" in r.lower() or r.rstrip().endswith(":)"),
          ("Be casual and friendly.", "Keep it chill and informal.", "The user likes a relaxed, casual tone.",
           "Talk to me like a friend.")),
    Style("bullets", lambda qa, p: "\n".join(f"- {s}" for s in _sentences(qa.answer)),
          lambda r, p: all(line.lstrip().startswith(("- ", "* ")) for line in r.strip().splitlines() if line.strip()),
          ("Answer as a bullet list.", "Format every reply as bullet points.", "The user wants replies as a list of bullets.",
           "Use dashes to make a bulleted list.")),
]}

SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are Claw, a friendly assistant.",
                  "You are a concise and accurate assistant.", "")


# ---------------------------------------------------------------------------------------------
# Judging
# ---------------------------------------------------------------------------------------------


def _contains_word(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w]){re.escape(word.lower())}(?![\w])", text) is not None


def is_correct(qa: QA, reply: str) -> bool:
    """Whether `reply` carries the answer's content, whatever its style.

    Case is ignored, and so are prefixes, sign-offs, bullets and backticks: only the keywords count.
    """
    text = reply.lower().replace("`", "").replace("*", " ")
    return all(_contains_word(text, kw.replace("`", "")) for kw in qa.keywords)


# ---------------------------------------------------------------------------------------------
# Training dialogues
# ---------------------------------------------------------------------------------------------


@dataclass
class Dialogue:
    """Messages in chat-template form; every assistant message is a training target."""

    messages: list[dict] = field(default_factory=list)


def _styled_dialogue(pools, rng: random.Random, style_prob: float, hint_prob: float) -> Dialogue:
    turns = 2 if rng.random() < 0.15 else 1
    qas = [_sample_qa(pools, rng) for _ in range(turns)]
    system = rng.choice(SYSTEM_PROMPTS)
    style, param, via_hint = None, "", False
    if rng.random() < style_prob:
        style = STYLES[rng.choice(sorted(STYLES))]
        param = rng.choice(style.params)
        via_hint = rng.random() < hint_prob
        if not via_hint:
            system = (system + " " + style.instruction(rng, param)).strip()
    msgs = [{"role": "system", "content": system}] if system else []
    for i, qa in enumerate(qas):
        last = i == turns - 1
        user = qa.question
        if style and via_hint and last:
            user = with_hint(user, style.instruction(rng, param))
        # A hinted style applies to the hinted turn only; a system style to every turn.
        styled = style and (not via_hint or last)
        msgs.append({"role": "user", "content": user})
        msgs.append({"role": "assistant", "content": style.render(qa, param) if styled else qa.answer})
    return Dialogue(msgs)


def training_dialogues(n: int, seed: int, style_prob: float = 0.45, hint_prob: float = 0.4) -> list[Dialogue]:
    """`n` deterministic training dialogues (same seed, same list)."""
    rng = random.Random(seed)
    pools = _pool(False)
    return [_styled_dialogue(pools, rng, style_prob, hint_prob) for _ in range(n)]


def dialogue_text(dialogue: Dialogue) -> str:
    """Plain text of a dialogue, for tokenizer training."""
    return "\n".join(m["content"] for m in dialogue.messages)
