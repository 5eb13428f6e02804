"""The one configuration of a training job, saved with the adapter version it produced."""
from dataclasses import asdict, dataclass, field, fields

METHODS = ("binary", "opd", "combined", "offline")
OPD_MODES = ("token", "teacher")
# vLLM's --max-lora-rank accepts these; anything else would train an adapter vLLM can't serve.
VLLM_LORA_RANKS = (8, 16, 32, 64)
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class TrainingConfig:
    method: str = field(default="combined", metadata={"help": "binary (PPO on ±1), opd (hindsight OPD), "
                        "combined (L_PPO + alpha * L_OPD) or offline (OPD loss only, over all corrections)."})
    alpha: float = field(default=0.5, metadata={"help": "Weight of the OPD loss in the combined loss."})
    # 1e-6 is a full-fine-tuning rate; LoRA moves far fewer weights and needs ~100x more.
    lr: float = field(default=1e-3, metadata={"help": "AdamW learning rate for the LoRA weights."})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay."})
    lora_rank: int = field(default=8, metadata={"help": "LoRA rank r; one of 8/16/32/64 so vLLM can serve it."})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA scaling numerator (scale = lora_alpha / r)."})
    lora_dropout: float = field(default=0.0, metadata={"help": "LoRA dropout; 0 keeps steps deterministic."})
    target_modules: tuple = field(default=LORA_TARGET_MODULES, metadata={"help": "Modules that get LoRA A/B."})
    steps_per_job: int = field(default=16, metadata={"help": "Optimizer steps per job (each over the whole batch)."})
    batch_size: int = field(default=4, metadata={"help": "Corrected replies, or replies with a reward alone, that trigger a job."})
    # 24, not 8: in five seed/build pairs it kept as much of the base model or more, and learned as fast or
    # faster to step 4 (docs/training.md, the twenty-ninth check).
    replay_corrections: int = field(default=24, metadata={"help": "The user's newest corrections (a*) from earlier "
                                    "jobs that OPD trains on again beside the new batch; 0 = only the new batch."})
    micro_batch_size: int = field(default=8, metadata={"help": "Sequences per forward pass (gradient accumulation)."})
    clip_eps: float = field(default=0.2, metadata={"help": "PPO ratio clip epsilon (OpenClaw-RL: 0.2)."})
    reward_baseline: bool = field(default=True, metadata={"help": "Subtract the mean reward of the job's replies "
                                  "from each reward before PPO (losses.reward_baseline): a batch whose replies all got "
                                  "the same thumb moves the adapter through the KL alone. False: the ±1 itself."})
    kl_coef: float = field(default=0.1, metadata={"help": "Weight of the KL penalty (k3) on the replies PPO trains "
                           "on, held to the base model (thumbed-up replies: see kl_base_min_prob); "
                           "0 = off, as in OpenClaw-RL."})
    kl_base_min_prob: float = field(default=0.1, metadata={"help": "On thumbed-up replies, the tokens the base "
                                    "model gives at least this probability are held by the KL to the base model, the "
                                    "rest to the version the job starts from (trainer.kl_reference); 0 = every "
                                    "token to that version."})
    distill_kept_tokens: bool = field(default=True, metadata={"help": "Tokens of a* that the user kept from the "
                                      "reply they corrected learn the base model's distribution (KL) instead of "
                                      "the sampled tokens themselves; False = plain -log p(a*) on every token."})
    distill_min_base_prob: float = field(default=0.1, metadata={"help": "With distill_kept_tokens, only the kept "
                                         "tokens that the base model itself gives at least this probability are held to "
                                         "its distribution; the kept tokens it finds less likely (the style the adapter "
                                         "has begun to write) learn as a* (trainer.mark_held_tokens). 0 = every kept token."})
    opd_slip_prob: float = field(default=0.05, metadata={"help": "Kept tokens of a* that the sampler drew with "
                                 "probability below this (slips of sampling, such as a wrong digit) are left out of "
                                 "the OPD loss (trainer.slip_tokens); 0 = every token of a* counts."})
    opd_mode: str = field(default="token", metadata={"help": "token: -log p(a*|c') on the target; teacher: "
                          "advantage = clip(log p_teacher(a|c') - log p_old(a|c), ±1) in the PPO loss."})
    teacher_adv_clip: float = field(default=1.0, metadata={"help": "Clip of the teacher-mode token advantage."})
    max_grad_norm: float = field(default=1.0, metadata={"help": "Gradient norm clip."})
    kl_guard: float = field(default=2.0, metadata={"help": "Max mean per-token KL (nats) to the previous version "
                            "on the probe prompts; above it the job fails and nothing is published."})
    logp_guard_tolerance: float = field(default=0.05, metadata={"help": "Allowed drop (nats/token) of mean "
                                        "log p(a*) on directive samples before the job fails."})
    max_seq_len: int = field(default=1024, metadata={"help": "Longer sequences keep their newest tokens."})
    seed: int = field(default=0, metadata={"help": "Seed for LoRA init and any sampling."})

    def __post_init__(self):
        self.target_modules = tuple(self.target_modules)
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, not {self.method!r}")
        if self.opd_mode not in OPD_MODES:
            raise ValueError(f"opd_mode must be one of {OPD_MODES}, not {self.opd_mode!r}")
        if self.lora_rank not in VLLM_LORA_RANKS:
            raise ValueError(f"lora_rank must be one of {VLLM_LORA_RANKS} (vLLM-servable), not {self.lora_rank}")
        if not 0 < self.lr < 1:
            raise ValueError("lr must be in (0, 1)")
        if self.alpha < 0 or self.kl_coef < 0:
            raise ValueError("alpha and kl_coef must be >= 0")
        if not 0 < self.clip_eps < 1:
            raise ValueError("clip_eps must be in (0, 1)")
        if self.steps_per_job < 1 or self.batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("steps_per_job, batch_size and micro_batch_size must be >= 1")
        if self.replay_corrections < 0:
            raise ValueError("replay_corrections must be >= 0")
        if not (0 <= self.distill_min_base_prob < 1 and 0 <= self.kl_base_min_prob < 1):
            raise ValueError("distill_min_base_prob and kl_base_min_prob must be in [0, 1)")
        if not 0 <= self.opd_slip_prob < 1:
            raise ValueError("opd_slip_prob must be in [0, 1)")
        if self.max_grad_norm <= 0 or self.kl_guard <= 0 or self.teacher_adv_clip <= 0:
            raise ValueError("max_grad_norm, kl_guard and teacher_adv_clip must be > 0")
        if not set(self.target_modules) <= set(LORA_TARGET_MODULES):
            raise ValueError(f"target_modules must be among {LORA_TARGET_MODULES}")

    @classmethod
    def from_agent(cls, agent, *, offline=False, **overrides):
        """The config an agent's settings ask for; offline=True runs the OPD-only baseline."""
        from django.conf import settings

        values = dict(
            method="offline" if offline else agent.training_method,
            alpha=agent.alpha,
            lr=agent.learning_rate,
            lora_rank=agent.lora_rank,
            lora_alpha=2 * agent.lora_rank,
            steps_per_job=agent.steps_per_job,
            batch_size=agent.batch_size or settings.TRAIN_BATCH_SIZE,
            kl_coef=agent.kl_coef,
            distill_kept_tokens=agent.distill_kept_tokens,
            distill_min_base_prob=agent.distill_min_base_prob,
            kl_base_min_prob=agent.kl_base_min_prob,
        )
        values.update(overrides)
        return cls(**values)

    @classmethod
    def from_dict(cls, data):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def to_dict(self):
        data = asdict(self)
        data["target_modules"] = list(self.target_modules)
        return data

    @property
    def uses_ppo(self):
        return self.method in ("binary", "combined")

    @property
    def uses_opd(self):
        return self.method in ("opd", "combined", "offline")
