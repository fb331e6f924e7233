"""The training jobs: a LoRA update of sdflax.train against diffusers' LoRA scripts' update, each timed."""

from __future__ import annotations

import statistics

from .configs import TEXT_ENCODERS, configs_for
from .models import sdflax_pipeline, torch_models
from .timing import job_seconds, log, timed

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]  # the LoRA scripts' UNet targets


def train_batches(job, size, count):
    """`count` batches of one LoRA update each, the same for both frameworks: cached latents (the scripts'
    --cache_latents), random caption ids (SDXL: both tokenizers' and the size ids of a 1024² picture), the noise
    and the timesteps."""
    import numpy as np

    configs, batch = configs_for(job["family"], size), job["batches"][0]
    side = configs["size"] // 2 ** (len(configs["vae"]["block_out_channels"]) - 1)
    g = np.random.default_rng(0)
    out = []
    for _ in range(count):
        shape = (batch, configs["vae"]["latent_channels"], side, side)
        ids = (batch, 2, 77) if job["family"] == "sdxl" else (batch, 77)
        step = {"latents": g.standard_normal(shape, dtype=np.float32), "input_ids": g.integers(0, 49407, ids),
                "noise": g.standard_normal(shape, dtype=np.float32), "timesteps": g.integers(0, 1000, batch)}
        if job["family"] == "sdxl":
            step.update(original_size=np.full((batch, 2), configs["size"]), target_size=np.full((batch, 2),
                        configs["size"]), crops_coords_top_left=np.zeros((batch, 2), np.int64))
        out.append(step)
    return out


def train_figures(job, first, times, peak):
    median, batch = statistics.median(times), job["batches"][0]
    return {"batch": batch, "first_step_s": first, "seconds_per_step": median, "seconds_per_step_min": min(times),
            "seconds_per_step_max": max(times), "steps_per_s": 1 / median, "images_per_s": batch / median,
            "peak_memory_bytes": peak}


def train_sdflax(job, size, repeats):
    """sdflax.train's LoRA update (one compiled program): the UNet's frozen weights in bfloat16, the LoRA and
    Adam's state in float32, the text encoders run in the step."""
    import jax
    import jax.numpy as jnp

    from sdflax.train import TrainConfig, Trainer

    import_s = job_seconds()
    bf16 = jax.default_backend() != "cpu"
    pipeline, params = sdflax_pipeline(job["family"], size, jnp.bfloat16 if bf16 else jnp.float32)
    trainer = Trainer(pipeline, params, TrainConfig(method="lora", rank=job["rank"], lora_targets=LORA_TARGETS,
                                                    mixed_precision="bf16" if bf16 else "no"))
    del params
    jax.block_until_ready(trainer.state)
    build_s = job_seconds() - import_s
    batches = train_batches(job, size, repeats + 1)

    def call(i):
        step = dict(batches[i])
        draws = {k: step.pop(k) for k in ("noise", "timesteps")}
        trainer.step(step, **draws)
        jax.block_until_ready(trainer.state)

    log(f"sdflax train {job['family']} batch {job['batches'][0]} ...")
    first, times = timed(call, repeats)
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return {"import_s": import_s, "build_s": build_s, "dtype": "bfloat16" if bf16 else "float32",
            "device": jax.devices()[0].device_kind, "results": [train_figures(job, first, times, peak)]}


def train_diffusers(job, size, repeats):
    """diffusers' LoRA scripts' update (train_text_to_image_lora.py, its _sdxl twin): PEFT's LoRA layers on the
    UNet, the frozen weights in bfloat16 and the LoRA cast to float32 (`cast_training_params`), autocast, the
    scripts' loss line, clip_grad_norm_ and torch.optim.AdamW."""
    import torch
    import torch.nn.functional as F
    from diffusers import DDPMScheduler
    from peft import LoraConfig, inject_adapter_in_model

    import_s = job_seconds()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    models = torch_models(job["family"], size, device)
    unet = models["unet"]
    encoders = [models[name] for name in TEXT_ENCODERS if name in models]
    for model in (unet, *encoders):
        model.requires_grad_(False).to(dtype=dtype)
    inject_adapter_in_model(LoraConfig(r=job["rank"], lora_alpha=job["rank"], init_lora_weights="gaussian",
                                       target_modules=LORA_TARGETS), unet)
    trained = [p for n, p in unet.named_parameters() if "lora_" in n]
    for p in trained:
        p.data = p.data.float()
        p.requires_grad_(True)
    unet.train()
    optimizer = torch.optim.AdamW(trained, lr=1e-4, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8)
    scheduler = DDPMScheduler.from_config(configs_for(job["family"], size)["scheduler"])
    build_s = job_seconds() - import_s
    batches = train_batches(job, size, repeats + 1)
    tensor = lambda x: torch.from_numpy(x).to(device)  # noqa: E731

    def call(i):
        step = batches[i]
        latents, noise, timesteps = tensor(step["latents"]), tensor(step["noise"]), tensor(step["timesteps"])
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            noisy = scheduler.add_noise(latents, noise, timesteps)
            ids = tensor(step["input_ids"])
            if job["family"] == "sdxl":  # the SDXL script's encode_prompt: both encoders' penultimate states
                with torch.no_grad():
                    first_out = encoders[0](ids[:, 0], output_hidden_states=True)
                    second_out = encoders[1](ids[:, 1], output_hidden_states=True)
                states = torch.cat([first_out.hidden_states[-2], second_out.hidden_states[-2]], dim=-1)
                time_ids = torch.cat([tensor(step[k]) for k in ("original_size", "crops_coords_top_left",
                                                                 "target_size")], dim=1).to(states.dtype)
                extra = {"added_cond_kwargs": {"text_embeds": second_out.text_embeds, "time_ids": time_ids}}
            else:
                with torch.no_grad():
                    states = encoders[0](ids, return_dict=False)[0]
                extra = {}
            prediction = unet(noisy, timesteps, states, return_dict=False, **extra)[0]
        loss = F.mse_loss(prediction.float(), noise.float(), reduction="mean")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if cuda:
            torch.cuda.synchronize()

    log(f"diffusers train {job['family']} batch {job['batches'][0]} ...")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    first, times = timed(call, repeats)
    return {"import_s": import_s, "build_s": build_s, "dtype": str(dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)",
            "results": [train_figures(job, first, times, torch.cuda.max_memory_allocated() if cuda else None)]}
