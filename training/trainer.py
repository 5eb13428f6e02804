"""One training job on one (user, agent) LoRA adapter: PPO on ±1 rewards and hindsight OPD.

Run it from Python (Celery calls exactly this; nothing here knows about Django or Celery):

    from training.config import TrainingConfig
    from training.trainer import Example, train
    metrics = train(TrainingConfig(), examples, base_model_path="var/models/demo-chat",
                    init_adapter_dir=None, out_dir="/tmp/out", served_model_name="base")

Stages, top to bottom: load the model and adapter, tokenize, measure "before" (π_old where it is
missing, teacher logprobs, log p(a*), probe distributions), the optimizer loop, the guards, save.
"""
import math
import time
from dataclasses import dataclass, field
from difflib import SequenceMatcher

import torch

from . import losses
from .config import TrainingConfig

DEFAULT_PROBE_PROMPTS = ["Hello! Who are you?", "Explain what a list is in one sentence."]
PROBE_REPLY_TOKENS = 32  # length of the greedy probe replies along which the KL guard compares


class GuardFailed(Exception):
    """A guard stopped the job: nothing may be published."""


class Cancelled(Exception):
    """The user or staff cancelled the job; nothing may be published."""


@dataclass
class Example:
    """One training sample, reduced to what the numeric loop needs.

    kind: "eval" (Binary RL on the sampled reply), "directive" (OPD on a*), "hint" (teacher-mode
    OPD on the sampled reply under c'). prompt_ids / response_ids / old_logprobs are the stored
    generation (never re-tokenized); messages is c' for directive and hint examples.
    """

    kind: str
    sample_id: int = 0
    turn_id: int | None = None  # the reply the sample is about (None: a reply of its own)
    prompt_ids: list = field(default_factory=list)
    response_ids: list = field(default_factory=list)
    old_logprobs: list | None = None
    old_adapter_dir: str | None = None  # the adapter that produced the reply (None: base)
    reward: float = 0.0
    messages: list = field(default_factory=list)
    target_text: str = ""
    corrected_text: str = ""  # eval only: the user's correction of this reply, if they wrote one
    blamed: list | None = None  # eval only: 1 per response token a -1 falls on (see blamed_tokens); None: all
    original_ids: list = field(default_factory=list)  # directive only: the reply a* corrects, if stored
    original_logprobs: list | None = None  # directive only: the sampler's log p of each original_ids token
    edited: list | None = None  # directive only: 1 per target token the correction changed (see edited_tokens)
    slips: list | None = None  # directive only: 1 per kept target token the sampler drew improbably (see slip_tokens)
    held: list | None = None  # directive only: 1 per kept target token held to the base model (see mark_held_tokens)


def examples_from_samples(samples):
    """Plain Examples from TrainingSample rows (with .turn loaded). Samples whose turn lacks the
    stored token ids can't be scored without re-tokenizing, so they are returned separately.

    Returns:
        (examples, skipped_sample_ids)
    """
    examples, skipped = [], []
    # Every -1 on a corrected reply (the thumb, the correction, the next message) blames only what
    # the correction changed.
    corrections = {s.turn_id: s.target_text for s in samples if s.target_text}
    for s in samples:
        turn = s.turn
        version = turn.adapter_version
        stored = dict(
            sample_id=s.pk,
            turn_id=s.turn_id,
            prompt_ids=list(turn.prompt_token_ids or []),
            response_ids=list(turn.token_ids or []),
            old_logprobs=list(turn.logprobs) if turn.logprobs else None,
            old_adapter_dir=version.path if version is not None else None,
        )
        if s.target_text:
            examples.append(Example(kind="directive", sample_id=s.pk, messages=s.enhanced_messages or s.context_messages,
                                    target_text=s.target_text, original_ids=list(turn.token_ids or []),
                                    original_logprobs=list(turn.logprobs) if turn.logprobs else None))
        elif s.reward is not None or s.hint:
            if not stored["prompt_ids"] or not stored["response_ids"]:
                skipped.append(s.pk)
                continue
            if s.reward is not None:
                examples.append(Example(kind="eval", reward=float(s.reward),
                                        corrected_text=corrections.get(s.turn_id, ""), **stored))
            else:
                examples.append(Example(kind="hint", messages=s.enhanced_messages, **stored))
        else:
            skipped.append(s.pk)
    return examples, skipped


# Helpers
# ------------------------------------------------------------------------------


def pick_device(name="auto"):
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def template_ids(tokenizer, messages):
    """Token ids of a chat-templated prompt ending in the assistant header (for c' only: c comes
    stored from generation time)."""
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):  # transformers 5 may hand back a BatchEncoding
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return list(ids)


def end_token_id(tokenizer, model):
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0]
    return eos if eos is not None else tokenizer.eos_token_id


def load_policy(base_model_path, init_adapter_dir, config, device):
    """The base model with the adapter to continue training, or a fresh vLLM-safe LoRA."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(base_model_path)
    base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=dtype).to(device)
    torch.manual_seed(config.seed)  # LoRA A init
    if init_adapter_dir:
        model = PeftModel.from_pretrained(base, init_adapter_dir, is_trainable=True)
    else:
        # vLLM serves plain LoRA only: no bias, no modules_to_save, no DoRA.
        lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout,
                          target_modules=list(config.target_modules), bias="none", use_dora=False,
                          modules_to_save=None, task_type="CAUSAL_LM")
        model = get_peft_model(base, lora)
    model.to(device)
    return tokenizer, model


def truncate(prompt_ids, response_ids, max_len):
    """Keep the whole response and the newest prompt tokens that fit."""
    room = max(1, max_len - len(response_ids))
    return prompt_ids[-room:], response_ids[: max_len - 1]


def response_logprobs(model, pairs, device, pad_id, distributions=False):
    """log π(response | prompt) per response token, for a micro-batch of (prompt, response).

    Returns:
        (logprobs (B, Tr), mask (B, Tr)) with responses left-aligned and right-padded, and with
        distributions=True also the log-softmax over the vocabulary at those positions (B, Tr, V).
    """
    lengths = [len(p) + len(r) for p, r in pairs]
    L, Tr = max(lengths), max(len(r) for _, r in pairs)
    input_ids = torch.full((len(pairs), L), pad_id, dtype=torch.long)
    attention = torch.zeros((len(pairs), L), dtype=torch.long)
    positions = torch.zeros((len(pairs), Tr), dtype=torch.long)
    targets = torch.zeros((len(pairs), Tr), dtype=torch.long)
    mask = torch.zeros((len(pairs), Tr))
    for i, (p, r) in enumerate(pairs):
        input_ids[i, : len(p) + len(r)] = torch.tensor(p + r)
        attention[i, : len(p) + len(r)] = 1
        # The token at position len(p)+j is predicted by the logits at len(p)+j-1.
        positions[i, : len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        targets[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1.0
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions, targets, mask = positions.to(device), targets.to(device), mask.to(device)
    logits = model(input_ids=input_ids, attention_mask=attention).logits  # (B, L, V)
    picked = logits.gather(1, positions.unsqueeze(-1).expand(-1, -1, logits.size(-1)))  # (B, Tr, V)
    if distributions:
        return losses.gather_logprobs(picked, targets), mask, torch.log_softmax(picked.float(), dim=-1)
    return losses.gather_logprobs(picked, targets), mask


def token_diff(before, after):
    """difflib's opcodes turning one token sequence into the other (no junk heuristic)."""
    return SequenceMatcher(None, before, after, autojunk=False).get_opcodes()


def blamed_tokens(response_ids, corrected_ids, eos):
    """1 for each token of a reply that its correction replaced or deleted, and for each token
    before which it inserted words; 0 for the tokens it kept.

    A correction says where the reply went wrong: the -1 of a corrected reply falls there, not on
    the answer the user kept (a sign-off appended blames the reply's premature end, a prefix
    added blames the reply's first token, lowercasing blames the capitalized words). An empty
    correction blames everything.
    """
    n = len(response_ids)
    if not corrected_ids:
        return [1] * n
    if response_ids and response_ids[-1] == eos:
        corrected_ids = list(corrected_ids) + [eos]
    blamed = [0] * n
    for tag, i1, i2, _, _ in token_diff(response_ids, corrected_ids):
        if tag in ("replace", "delete"):
            blamed[i1:i2] = [1] * (i2 - i1)
        elif tag == "insert" and n:
            blamed[min(i1, n - 1)] = 1
    return blamed


def kept_positions(original_ids, target_ids, eos):
    """{j: i} for each token a*[j] (target_ids, ending in eos) that the user kept from the reply
    as sampled, i being its index in original_ids; the same token diff as blamed_tokens. The eos
    is never kept: where the reply stops is part of what the user said."""
    body = target_ids[:-1] if target_ids and target_ids[-1] == eos else list(target_ids)
    drawn = [i for i, t in enumerate(original_ids) if t != eos]
    kept = {}
    for tag, i1, i2, j1, _ in token_diff([original_ids[i] for i in drawn], body):
        if tag == "equal":
            kept.update({j1 + k: drawn[i1 + k] for k in range(i2 - i1)})
    return kept


def edited_tokens(original_ids, target_ids, eos):
    """1 for each token of a* (target_ids, ending in eos) that the user's correction changed or
    added, 0 for those they kept from the reply (original_ids) as it was sampled.

    The kept tokens are the model's own sample: with distill_kept_tokens, OPD holds them to the
    base model's distribution instead of teaching the sampled tokens again, slips included (see
    losses.opd_loss). The eos always counts as changed.
    """
    kept = kept_positions(original_ids, target_ids, eos)
    return [0 if j in kept else 1 for j in range(len(target_ids))]


def slip_tokens(original_ids, original_logprobs, target_ids, eos, max_prob):
    """1 for each token of a* that the user kept from the reply and that the sampler drew with
    probability below max_prob (its raw log p, stored at generation): a slip of sampling, such as
    a wrong digit at temperature 0.7. 0 everywhere else, and everywhere without stored logprobs.

    OPD skips the slips: the user kept them because they judged the style, not because those
    tokens are right, and -log p is steepest on exactly such improbable tokens. Kept tokens the
    model drew with confidence (the half-learned style among them) still count.
    """
    if not original_logprobs or len(original_logprobs) != len(original_ids) or max_prob <= 0:
        return [0] * len(target_ids)
    kept, threshold = kept_positions(original_ids, target_ids, eos), math.log(max_prob)
    return [int(j in kept and original_logprobs[kept[j]] < threshold) for j in range(len(target_ids))]


def reply_rewards(evals):
    """Each reply's reward, the mean of its samples': a corrected reply carries two or three -1s
    (the thumb, the correction, the next message), and the baseline compares replies, not samples."""
    by_reply = {}
    for e in evals:
        by_reply.setdefault(id(e) if e.turn_id is None else e.turn_id, []).append(e.reward)
    return [sum(rewards) / len(rewards) for rewards in by_reply.values()]


def unblamed_mask(examples, mask):
    """mask without the tokens a correction changed: the KL to the reference holds what the user
    kept, and leaves free what they asked to change (a prefix where the reply began, say)."""
    return mask * (1 - padded([e.blamed or [] for e in examples], mask.size(1), mask.device))


def padded(rows, width, device):
    out = torch.zeros((len(rows), width), device=device)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


def chunks(items, size):
    return [items[i : i + size] for i in range(0, len(items), size)]


@torch.no_grad()
def mean_target_logprob(model, directive, device, pad_id, micro):
    """Mean log p(a*_i | c', a*_<i) over the target tokens the correction changed (nats/token);
    None without targets."""
    total, count = 0.0, 0
    for group in chunks(directive, micro):
        lp, mask = response_logprobs(model, [(e.prompt_ids, e.response_ids) for e in group], device, pad_id)
        mask = mask * padded([e.edited for e in group], mask.size(1), device)
        total += (lp * mask).sum().item()  # CPU-GPU sync point
        count += int(mask.sum().item())
    return total / count if count else None


@torch.no_grad()
def kl_reference(model, e, min_base_prob, device, pad_id):
    """Per token of e's reply, the log p that the KL penalty holds it to.

    The base model's where PPO pushes down: without that anchor, thumbs down alone drive an
    adapter to garbage over a few jobs. On a thumbed-up reply, the version the job starts from, so
    that a learned style is not pulled back to the base; but the tokens the base model itself
    gives at least min_base_prob are content it would write anyway, and stay held to the base
    (0: none are). The user judged the style: their thumb does not vouch for a wrong sum.
    """
    def logprobs():
        lp, mask = response_logprobs(model, [(e.prompt_ids, e.response_ids)], device, pad_id)
        return lp[0, : int(mask.sum())].tolist()

    approved = e.kind == "eval" and e.reward > 0
    if approved:
        start = logprobs()
        if not min_base_prob:
            return start
    with model.disable_adapter():
        base = logprobs()
    if not approved:
        return base
    threshold = math.log(min_base_prob)
    return [b if b >= threshold else s for b, s in zip(base, start)]


@torch.no_grad()
def mark_held_tokens(model, directive, min_base_prob, device, pad_id, micro):
    """Set e.held: 1 for each token of a* that the user kept and that the base model itself gives
    at least min_base_prob; OPD holds those to the base model's distribution (distill_kept_tokens).

    A kept token the base model finds plausible is content it would write anyway: learning it as
    a* only sharpens the sample, wrong digits included. A kept token it finds implausible is the
    style the adapter has begun to write (a sign-off after the answer, a prefix, a lowercased
    name): held to the base, the next correction would unlearn it, so it stays in -log p(a*).
    Slips of sampling that are held count as held, not as slips.

    Returns, per micro-batch of directive, the base model's log-softmax at the held positions
    (N, V). The base model is frozen, so the job reads them here once rather than at every step;
    kept at the held positions only, a large vocabulary costs memory only where OPD uses it.
    """
    threshold = math.log(min_base_prob) if min_base_prob > 0 else -math.inf
    out = []
    with model.disable_adapter():
        for group in chunks(directive, micro):
            lp, mask, dist = response_logprobs(model, [(e.prompt_ids, e.response_ids) for e in group], device, pad_id,
                                               distributions=True)
            for e, row in zip(group, lp.tolist()):
                e.held = [int(not edited and base_lp >= threshold) for edited, base_lp in zip(e.edited, row)]
                e.slips = [int(slip and not held) for slip, held in zip(e.slips, e.held)]
            out.append(dist[padded([e.held for e in group], mask.size(1), device).bool()])
    return out


@torch.no_grad()
def probe_replies(model, probe_ids, device, eos, pad_id):
    """(prompt, greedy reply) per probe, from the policy before this job's steps.

    The guard compares next-token distributions along these replies: the behaviour a user would
    see, not the prompt-token predictions, which no loss constrains and which drift freely.
    """
    out = []
    for ids in probe_ids:
        generated = model.generate(torch.tensor([ids], device=device), max_new_tokens=PROBE_REPLY_TOKENS,
                                   do_sample=False, temperature=None, top_p=None, top_k=None,
                                   eos_token_id=eos, pad_token_id=pad_id)
        out.append((ids, generated[0, len(ids):].tolist()))
    return out


@torch.no_grad()
def probe_distributions(model, probes, device):
    """log-softmax over the vocabulary at the positions that predict each probe reply token."""
    out = []
    for prompt, reply in probes:
        ids = prompt + reply
        logits = model(input_ids=torch.tensor([ids], device=device)).logits[:, len(prompt) - 1 : len(ids) - 1]
        out.append(torch.log_softmax(logits.float(), dim=-1))
    return out


@torch.no_grad()
def probe_kl(model, probes, probes_before, device):
    """Mean per-token KL(now || before) along the probe replies: how far behaviour moved."""
    probes_now = probe_distributions(model, probes, device)
    return sum(
        losses.distribution_kl(now, before, torch.ones(now.shape[:2], device=device)).item()
        for now, before in zip(probes_now, probes_before)
    ) / max(1, len(probes))


def lora_state(params):
    return [p.detach().clone() for p in params]


@torch.no_grad()
def restore_lora_state(params, state):
    for p, saved in zip(params, state):
        p.copy_(saved)


@torch.no_grad()
def logprobs_with_adapter(model, adapter_dir, init_adapter_dir, pairs, device, pad_id):
    """Per-token logprobs of stored replies under the adapter that produced them (π_old when
    the turn didn't store its logprobs)."""
    if adapter_dir is None:
        with model.disable_adapter():
            lp, mask = response_logprobs(model, pairs, device, pad_id)
    elif adapter_dir == init_adapter_dir:
        lp, mask = response_logprobs(model, pairs, device, pad_id)
    else:
        model.load_adapter(adapter_dir, adapter_name="old_policy")
        model.set_adapter("old_policy")
        try:
            lp, mask = response_logprobs(model, pairs, device, pad_id)
        finally:
            model.set_adapter("default")
            model.delete_adapter("old_policy")
            # set_adapter froze the other adapter; the trainable one must learn again.
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.requires_grad_(True)
    return [row[: int(m.sum())].tolist() for row, m in zip(lp, mask)]


# The job
# ------------------------------------------------------------------------------


def train(config: TrainingConfig, examples, *, base_model_path, init_adapter_dir, out_dir, served_model_name,
          probe_prompts=None, progress=None, should_stop=None, device="auto"):
    """Train the adapter on one batch and save it to out_dir (safetensors).

    Args:
        examples: list of Example.
        init_adapter_dir: the active version's directory to continue from, or None (fresh LoRA).
        progress: callable(percent: int, metrics: dict) called after each step.
        should_stop: callable() -> bool, checked before each step (cancel).
    Returns:
        Metrics dict: loss parts, reward mean, samples used, probe KL, log p(a*) before/after,
        duration. Raises GuardFailed or Cancelled; out_dir is then left untouched.
    """
    started = time.monotonic()
    device = pick_device(device)
    progress = progress or (lambda percent, metrics: None)
    should_stop = should_stop or (lambda: False)

    # 1. model, tokenizer, which examples this method uses
    tokenizer, model = load_policy(base_model_path, init_adapter_dir, config, device)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = end_token_id(tokenizer, model)
    wanted = {"binary": {"eval"}, "opd": {"directive", "hint"}, "combined": {"eval", "directive", "hint"},
              "offline": {"directive"}}[config.method]
    if config.opd_mode != "teacher":
        wanted = wanted - {"hint"}  # a hint without a* only teaches through the teacher
    used = [e for e in examples if e.kind in wanted]
    skipped = [e.sample_id for e in examples if e.kind not in wanted]
    if not used:
        raise GuardFailed(f"no sample usable by method {config.method} (opd_mode {config.opd_mode})")

    # 2. tokens: c' and a* are text (never generated), the rest is stored ids
    for e in used:
        if e.kind == "directive":
            target = tokenizer(e.target_text, add_special_tokens=False)["input_ids"] + [eos]
            e.prompt_ids, e.response_ids = truncate(template_ids(tokenizer, e.messages), target, config.max_seq_len)
            e.edited = edited_tokens(e.original_ids, e.response_ids, eos)
            e.slips = slip_tokens(e.original_ids, e.original_logprobs, e.response_ids, eos, config.opd_slip_prob)
        else:
            if e.old_logprobs is not None and len(e.old_logprobs) != len(e.response_ids):
                e.old_logprobs = None  # a torn record: recompute rather than misalign
            e.prompt_ids, e.response_ids = truncate(e.prompt_ids, e.response_ids, config.max_seq_len)
            if e.old_logprobs is not None:
                e.old_logprobs = e.old_logprobs[: len(e.response_ids)]
    for e in used:
        if e.kind == "eval" and e.corrected_text and e.reward < 0:
            corrected = tokenizer(e.corrected_text, add_special_tokens=False)["input_ids"]
            e.blamed = blamed_tokens(e.response_ids, corrected, eos)
    evals = [e for e in used if e.kind == "eval"]
    baseline = losses.reward_baseline(reply_rewards(evals)) if config.reward_baseline else 0.0
    hints = [e for e in used if e.kind == "hint"]
    directive = [e for e in used if e.kind == "directive"]
    micro = config.micro_batch_size

    # 3. before training: π_old where missing, teacher and reference logprobs, log p(a*), probes
    model.eval()
    for e in evals + hints:
        if e.old_logprobs is None:
            e.old_logprobs = logprobs_with_adapter(model, e.old_adapter_dir, init_adapter_dir,
                                                   [(e.prompt_ids, e.response_ids)], device, pad_id)[0]
    teacher = {}
    with torch.no_grad(), model.disable_adapter():
        for e in hints:
            c_prime = truncate(template_ids(tokenizer, e.messages), e.response_ids, config.max_seq_len)[0]
            lp, mask = response_logprobs(model, [(c_prime, e.response_ids)], device, pad_id)
            teacher[id(e)] = lp[0, : int(mask.sum())].tolist()
    reference = {}
    if config.kl_coef:
        for e in evals + hints:
            reference[id(e)] = kl_reference(model, e, config.kl_base_min_prob, device, pad_id)
    if config.distill_kept_tokens:
        base_held = mark_held_tokens(model, directive, config.distill_min_base_prob, device, pad_id, micro)
    logp_before = mean_target_logprob(model, directive, device, pad_id, micro)
    probes = [template_ids(tokenizer, [{"role": "user", "content": p}]) for p in (probe_prompts or DEFAULT_PROBE_PROMPTS)]
    probes = probe_replies(model, probes, device, eos, pad_id)
    probes_before = probe_distributions(model, probes, device)

    # 4. the loop: every step sees the whole batch, in micro-batches weighted by token count
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    ppo_set = [(e, "reward") for e in evals] + [(e, "teacher") for e in hints]
    ppo_tokens = sum(len(e.response_ids) for e, _ in ppo_set)
    opd_tokens = sum(len(e.response_ids) - sum(e.slips) for e in directive)
    # L = L_PPO + α L_OPD only when both signals train; a lone OPD objective keeps weight 1.
    alpha = config.alpha if config.method == "combined" else 1.0
    history = []
    accepted = lora_state(params)
    model.train()
    for step in range(config.steps_per_job):
        if should_stop():
            raise Cancelled(f"cancelled before step {step + 1}")
        parts = {"ppo": 0.0, "opd": 0.0, "teacher": 0.0, "kl": 0.0, "clip_frac": 0.0}

        # forward/backward, PPO part: eval rows get A = reward - baseline (on the blamed tokens of a
        # corrected reply), hint rows the teacher advantage
        for group in chunks(ppo_set, micro):
            lp, mask = response_logprobs(model, [(e.prompt_ids, e.response_ids) for e, _ in group], device, pad_id)
            old = padded([e.old_logprobs for e, _ in group], lp.size(1), device)
            adv = torch.zeros_like(lp)
            for i, (e, source) in enumerate(group):
                n = len(e.response_ids)
                if source == "reward":
                    advantage = e.reward - baseline
                    adv[i, :n] = advantage if e.blamed is None else advantage * torch.tensor(e.blamed, device=device)
                else:
                    t = torch.tensor(teacher[id(e)], device=device)
                    adv[i, :n] = losses.teacher_advantages(t, old[i, :n], mask[i, :n], clip=config.teacher_adv_clip)
            weight = mask.sum() / ppo_tokens
            is_teacher = torch.tensor([s == "teacher" for _, s in group], device=device).unsqueeze(-1)
            rl_mask, teacher_mask = mask * ~is_teacher, mask * is_teacher
            ppo = losses.ppo_clip_loss(lp, old, adv, rl_mask, clip_eps=config.clip_eps) * (rl_mask.sum() / ppo_tokens)
            teach = losses.ppo_clip_loss(lp, old, adv, teacher_mask, clip_eps=config.clip_eps) * (teacher_mask.sum() / ppo_tokens)
            kl = torch.zeros((), device=device)
            if config.kl_coef:
                ref = padded([reference[id(e)] for e, _ in group], lp.size(1), device)
                held = unblamed_mask([e for e, _ in group], mask)
                kl = losses.kl_penalty(lp, ref, held) * (held.sum() / ppo_tokens)
            # Teacher-mode OPD rides on the PPO loss but belongs to the OPD term (Eq.: L_PPO + α L_OPD).
            loss = losses.combined_loss(ppo, teach, alpha=alpha, kl=kl, kl_coef=config.kl_coef)
            loss.backward()
            parts["ppo"] += ppo.item()  # CPU-GPU sync point
            parts["teacher"] += teach.item()
            parts["kl"] += kl.item()
            parts["clip_frac"] += (losses.ppo_clip_fraction(lp, old, mask, clip_eps=config.clip_eps) * weight).item()

        # forward/backward, OPD part: -log p(a* | c') on target tokens (distill_kept_tokens: on the
        # tokens the user changed, and KL to the base model on those they kept)
        for g, group in enumerate(chunks(directive, micro)):
            pairs = [(e.prompt_ids, e.response_ids) for e in group]
            if config.distill_kept_tokens:
                lp, mask, dist = response_logprobs(model, pairs, device, pad_id, distributions=True)
                mask = mask * (1 - padded([e.slips for e in group], mask.size(1), device))
                held = padded([e.held for e in group], mask.size(1), device)
                kept_kl, at_held = torch.zeros_like(lp), held.bool()
                kept_kl[at_held] = losses.position_kl(base_held[g], dist[at_held])
                opd = losses.opd_loss(lp, mask, kept_mask=held, kept_kl=kept_kl)
            else:
                lp, mask = response_logprobs(model, pairs, device, pad_id)
                mask = mask * (1 - padded([e.slips for e in group], mask.size(1), device))
                opd = losses.opd_loss(lp, mask)
            opd = opd * (mask.sum() / opd_tokens)
            (alpha * opd).backward()
            parts["opd"] += opd.item()

        # every loss finite, or nothing is published
        for name, value in parts.items():
            if not math.isfinite(value):
                raise GuardFailed(f"non-finite {name} loss ({value}) at step {step + 1}")
        grad_norm = torch.nn.utils.clip_grad_norm_(params, config.max_grad_norm).item()
        if not math.isfinite(grad_norm):
            raise GuardFailed(f"non-finite gradient norm at step {step + 1}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # trust region: a step that takes the probes' behaviour past kl_guard is undone and ends
        # the job (the early stop on a KL target of PPO implementations); none accepted: failed
        model.eval()
        kl_now = probe_kl(model, probes, probes_before, device)
        model.train()
        if not math.isfinite(kl_now) or kl_now > config.kl_guard:
            if not history:
                raise GuardFailed(f"KL to the previous version on the probe prompts is {kl_now:.4f} > "
                                  f"{config.kl_guard} after the first step")
            restore_lora_state(params, accepted)
            break
        accepted = lora_state(params)
        parts["total"] = parts["ppo"] + alpha * (parts["opd"] + parts["teacher"]) + config.kl_coef * parts["kl"]
        parts["grad_norm"] = grad_norm
        parts["probe_kl"] = kl_now
        history.append(parts)
        progress(int(100 * (step + 1) / config.steps_per_job), parts)

    # 5. guard: log p(a*) didn't fall (the probes' KL is within kl_guard by construction)
    model.eval()
    logp_after = mean_target_logprob(model, directive, device, pad_id, micro)
    if logp_before is not None and logp_after < logp_before - config.logp_guard_tolerance:
        raise GuardFailed(f"mean log p(a*) fell from {logp_before:.4f} to {logp_after:.4f}")

    # 6. save: the served model's name as the base, safetensors only
    for peft_config in model.peft_config.values():
        peft_config.base_model_name_or_path = served_model_name
    # save_embedding_layers=False: LoRA only (and no hub lookup of the base by its served name).
    model.save_pretrained(out_dir, safe_serialization=True, save_embedding_layers=False)

    last = history[-1]
    return {
        "loss": last["total"],
        "loss_ppo": last["ppo"],
        "loss_opd": last["opd"],
        "loss_teacher": last["teacher"],
        "loss_kl": last["kl"],
        "clip_frac": last["clip_frac"],
        "loss_first": history[0]["total"],
        "reward_mean": (sum(e.reward for e in evals) / len(evals)) if evals else None,
        "reward_baseline": baseline,
        "samples_used": len(used),
        "samples_skipped": skipped,
        "eval_samples": len(evals),
        "directive_samples": len(directive),
        "opd_slips_skipped": sum(sum(e.slips) for e in directive),
        "opd_held_tokens": sum(sum(e.held or []) for e in directive),
        "hint_samples": len(hints),
        "steps": len(history),
        "stopped_early": len(history) < config.steps_per_job,
        "probe_kl": last["probe_kl"],
        "logp_target_before": logp_before,
        "logp_target_after": logp_after,
        "duration_s": round(time.monotonic() - started, 3),
        "device": str(device),
    }
