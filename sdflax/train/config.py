"""`TrainConfig`: what a training run does, spelled as diffusers' training scripts spell their arguments (and with
their defaults), so that a script's command line reads across."""

from __future__ import annotations

import dataclasses
import math

METHODS = ("lora", "full", "textual_inversion")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
MIXED_PRECISIONS = ("no", "bf16", "fp16")
PREDICTION_TYPES = (None, "epsilon", "v_prediction")
LORA_INITS = ("default", "gaussian")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run's settings. `method`: "lora" (low-rank adapters on `lora_targets`, the model frozen), "full"
    (every UNet weight; the text encoder too with `train_text_encoder`) or "textual_inversion" (one new token's
    embedding rows). DreamBooth is "lora" or "full" with `with_prior_preservation`."""

    method: str = "lora"
    learning_rate: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_weight_decay: float = 1e-2
    adam_epsilon: float = 1e-8
    max_grad_norm: float | None = 1.0  # None: no clipping (diffusers' textual-inversion script clips nothing)
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 500
    max_train_steps: int | None = None  # the optimizer updates "linear" and "cosine" decay over
    gradient_accumulation_steps: int = 1
    snr_gamma: float | None = None  # min-SNR-γ weighting (Hang et al. 2023); 5.0 is the paper's choice
    noise_offset: float = 0.0
    prediction_type: str | None = None  # None: the scheduler's
    # "bf16" / "fp16": the models compute in bfloat16 / float16; trained weights and Adam stay float32; fp16 with
    # accelerate's dynamic loss scale (optim.LossScale)
    mixed_precision: str = "no"
    gradient_checkpointing: bool = False  # recompute each UNet block's activations in the backward pass
    use_ema: bool = False
    ema_decay: float = 0.9999  # diffusers' EMAModel: decay min(ema_decay, (1 + n) / (10 + n)) after n updates
    train_text_encoder: bool = False  # the text encoder(s) too: LoRA on `text_encoder_lora_targets`, or full
    with_prior_preservation: bool = False  # DreamBooth: each batch is [instance rows; class rows]
    prior_loss_weight: float = 1.0
    rank: int = 4
    lora_alpha: float | None = None  # None: `rank` (scale 1), as diffusers' LoRA scripts
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    text_encoder_lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj")
    init_lora_weights: str = "default"  # PEFT's: "default" (A Kaiming-uniform), "gaussian" (A ~ N(0, 1/rank)); B = 0
    placeholder_token: str | None = None  # textual inversion: the new token, e.g. "<cat-toy>"
    initializer_token: str | None = None  # ... whose embedding the new one starts from
    num_vectors: int = 1  # ... vectors the new token has (tokens <t>, <t>_1, ...)

    def __post_init__(self):
        for field, allowed in (("method", METHODS), ("lr_scheduler", LR_SCHEDULERS),
                               ("mixed_precision", MIXED_PRECISIONS), ("prediction_type", PREDICTION_TYPES),
                               ("init_lora_weights", LORA_INITS)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"TrainConfig: {field}={getattr(self, field)!r} is not one of {allowed}")
        for field in ("learning_rate", "adam_epsilon", "prior_loss_weight", "ema_decay"):
            _number(field, getattr(self, field), low=0.0)
        for field in ("adam_beta1", "adam_beta2"):
            _number(field, getattr(self, field), low=0.0, high=1.0, high_open=True)
        _number("adam_weight_decay", self.adam_weight_decay, low=0.0)
        _number("noise_offset", self.noise_offset, low=0.0)
        for field in ("max_grad_norm", "snr_gamma", "lora_alpha"):
            if getattr(self, field) is not None:
                _number(field, getattr(self, field), low=0.0, low_open=True)
        for field, low in (("rank", 1), ("gradient_accumulation_steps", 1), ("lr_warmup_steps", 0),
                           ("num_vectors", 1)):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"TrainConfig: {field}={value!r} must be an integer >= {low}")
        if self.max_train_steps is not None and (not isinstance(self.max_train_steps, int) or
                                                 self.max_train_steps < 1):
            raise ValueError(f"TrainConfig: max_train_steps={self.max_train_steps!r} must be an integer >= 1")
        if self.lr_scheduler in ("linear", "cosine") and self.max_train_steps is None:
            raise ValueError(f"TrainConfig: lr_scheduler={self.lr_scheduler!r} decays to 0 over the run: give "
                             "max_train_steps")
        for field in ("lora_targets", "text_encoder_lora_targets"):
            value = getattr(self, field)
            if isinstance(value, str) or not value or not all(isinstance(t, str) and t for t in value):
                raise ValueError(f"TrainConfig: {field}={value!r} must be a tuple of module names, e.g. "
                                 "('to_q', 'to_out.0')")
        if self.method == "textual_inversion":
            if not self.placeholder_token or not self.initializer_token:
                raise ValueError("TrainConfig: textual inversion needs placeholder_token (the new token, e.g. "
                                 "'<cat-toy>') and initializer_token (an existing word it starts from, e.g. 'toy')")
            if self.train_text_encoder:
                raise ValueError("TrainConfig: textual inversion trains the new token's embedding only; "
                                 "train_text_encoder is for method='lora' or 'full'")
        elif self.placeholder_token or self.initializer_token:
            raise ValueError(f"TrainConfig: placeholder_token / initializer_token are for "
                             f"method='textual_inversion', not {self.method!r}")

    @property
    def alpha(self) -> float:
        return float(self.rank if self.lora_alpha is None else self.lora_alpha)


def _number(field, value, low=None, high=None, low_open=False, high_open=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (low is None or (value > low if low_open else value >= low))
    ok = ok and (high is None or (value < high if high_open else value <= high))
    if not ok:
        opening, closing = "(" if low_open else "[", ")" if high_open or high is None else "]"
        bounds = f"{opening}{low}, {'inf' if high is None else high}{closing}"
        raise ValueError(f"TrainConfig: {field}={value!r} must be a finite number in {bounds}")
