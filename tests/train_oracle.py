"""diffusers' training scripts as the oracle of sdflax.train: their loss lines (`train_text_to_image_lora.py`,
`train_dreambooth_lora.py`, `train_text_to_image_lora_sdxl.py`, `textual_inversion.py`), PEFT's LoRA layers on the
PyTorch models, `torch.optim.AdamW`, `clip_grad_norm_`, `diffusers.optimization.get_scheduler`, accelerate's
gradient accumulation (each micro-batch's loss divided by their number) and `diffusers.training_utils.EMAModel`."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def script_loss(models, scheduler, batch, noise, timesteps, config, offset_noise=None):
    """One micro-batch's loss, line by line as the scripts compute it (torch tensors in, a scalar out)."""
    from diffusers.training_utils import compute_snr

    latents = batch["latents"]
    if config.noise_offset:
        noise = noise + config.noise_offset * offset_noise
    noisy_latents = scheduler.add_noise(latents, noise, timesteps)
    if "text_encoder_2" in models:  # train_text_to_image_lora_sdxl.py's encode_prompt and add_time_ids
        states, pooled = [], None
        for i, name in enumerate(("text_encoder", "text_encoder_2")):
            out = models[name](batch["input_ids"][:, i], output_hidden_states=True, return_dict=False)
            pooled = out[0]
            states.append(out[-1][-2])
        encoder_hidden_states = torch.cat(states, dim=-1)
        time_ids = torch.cat([batch["original_size"], batch["crops_coords_top_left"], batch["target_size"]], dim=1)
        extra = {"added_cond_kwargs": {"time_ids": time_ids, "text_embeds": pooled}}
    else:
        encoder_hidden_states = models["text_encoder"](batch["input_ids"], return_dict=False)[0]
        extra = {}
    if config.prediction_type is not None:
        scheduler.register_to_config(prediction_type=config.prediction_type)
    if scheduler.config.prediction_type == "epsilon":
        target = noise
    else:
        target = scheduler.get_velocity(latents, noise, timesteps)
    model_pred = models["unet"](noisy_latents, timesteps, encoder_hidden_states, return_dict=False, **extra)[0]
    if config.with_prior_preservation:  # train_dreambooth_lora.py
        model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
        target, target_prior = torch.chunk(target, 2, dim=0)
        timesteps = torch.chunk(timesteps, 2, dim=0)[0]
    if config.snr_gamma is None:
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
    else:
        snr = compute_snr(scheduler, timesteps)
        mse_loss_weights = torch.stack([snr, config.snr_gamma * torch.ones_like(timesteps)], dim=1).min(dim=1)[0]
        if scheduler.config.prediction_type == "epsilon":
            mse_loss_weights = mse_loss_weights / snr
        elif scheduler.config.prediction_type == "v_prediction":
            mse_loss_weights = mse_loss_weights / (snr + 1)
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="none")
        loss = loss.mean(dim=list(range(1, len(loss.shape)))) * mse_loss_weights
        loss = loss.mean()
    if config.with_prior_preservation:
        prior_loss = F.mse_loss(model_pred_prior.float(), target_prior.float(), reduction="mean")
        loss = loss + config.prior_loss_weight * prior_loss
    return loss


def train(models, scheduler, trained, batches, draws, config, ema_model=None, restore_rows=None):
    """`len(batches)` optimizer updates as the scripts run them -> the losses (the mean over micro-batches).
    `trained`: the tensors the optimizer updates; `batches[i]` / `draws[i]`: update i's micro-batches and their
    (noise, timesteps, offset noise). `restore_rows` (textual_inversion.py): (embedding weight, the rows that may
    change, the original weight), the others restored after each update."""
    from diffusers.optimization import get_scheduler

    optimizer = torch.optim.AdamW(trained, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2),
                                  weight_decay=config.adam_weight_decay, eps=config.adam_epsilon)
    lr_scheduler = get_scheduler(config.lr_scheduler, optimizer=optimizer, num_warmup_steps=config.lr_warmup_steps,
                                 num_training_steps=config.max_train_steps)
    losses = []
    for micro_batches, micro_draws in zip(batches, draws):
        total = 0.0
        for batch, (noise, timesteps, offset) in zip(micro_batches, micro_draws):
            loss = script_loss(models, scheduler, batch, noise, timesteps, config, offset)
            (loss / len(micro_batches)).backward()
            total += loss.item() / len(micro_batches)
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trained, config.max_grad_norm)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        if restore_rows is not None:
            weight, keep, original = restore_rows
            with torch.no_grad():
                rows = torch.ones(len(weight), dtype=torch.bool)
                rows[keep] = False
                weight[rows] = original[rows]
        if ema_model is not None:
            ema_model.step(trained)
        losses.append(total)
    return losses


def add_peft_lora(model, targets, rank, alpha, init=None):
    """PEFT's LoRA layers (the scripts' LoraConfig) on `model`; `init` {module name: (down, up)} sets A and B."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                                       init_lora_weights="gaussian"), model)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (down, up) in (init or {}).items():
            name = name if name in modules else name.removeprefix("text_model.")  # transformers 5's CLIP
            modules[name].lora_A["default"].weight.copy_(torch.from_numpy(np.array(down)))
            modules[name].lora_B["default"].weight.copy_(torch.from_numpy(np.array(up)))
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in model.parameters():
        p.requires_grad_(False)
    for p in lora:
        p.requires_grad_(True)
    return lora


def lora_weights(model) -> dict:
    """{module name: (down, up)} of a PEFT-injected model, as numpy."""
    clip = lambda name: name.startswith(("encoder.", "embeddings.", "final_layer_norm"))  # noqa: E731
    return {"text_model." * clip(name) + name: (m.lora_A["default"].weight.detach().numpy(),
                                                m.lora_B["default"].weight.detach().numpy())
            for name, m in model.named_modules() if hasattr(m, "lora_A")}
