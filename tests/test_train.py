"""sdflax.train against diffusers' training scripts (tests/train_oracle.py), float32 on the CPU, on the small random
models of builders.py: the loss of a batch at 1e-5 relative, the trained weights after three updates at 1e-4."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from builders import torch_pipeline
from train_oracle import add_peft_lora, lora_weights, script_loss, train

import jax
import jax.numpy as jnp
from flax import traverse_util

from sdflax import StableDiffusion
from sdflax.train.files import write_safetensors
from sdflax.train import TrainConfig, Trainer
from sdflax.train.lora import torch_name
from sdflax.train.optim import LossScale

LOSS_RTOL = 1e-5
WEIGHT_RTOL = 1e-4
UPDATES = 3
LATENT = (4, 8, 8)  # the latents' (C, h, w): 16x16 pictures for these two-level VAEs
CAPTIONS = ["a photo of a red fox", "a watercolour of a lighthouse", "a cat on a sofa", "mountains at dawn"]


@pytest.fixture(scope="module")
def sd1(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sd1")
    theirs = torch_pipeline("sd1")
    theirs.save_pretrained(folder)
    return theirs, *StableDiffusion.from_pretrained(folder)


def ddpm(theirs):
    from diffusers import DDPMScheduler

    return DDPMScheduler.from_config(theirs.scheduler.config)


def data(pipe, rows, updates=UPDATES, seed=0):
    """Per update: a batch of `rows` rows (latents, ids) and its draws (noise, timesteps, offset noise)."""
    g = np.random.default_rng(seed)
    out = []
    for i in range(updates):
        captions = [CAPTIONS[(i + j) % len(CAPTIONS)] for j in range(rows)]
        batch = {"latents": g.standard_normal((rows, *LATENT)).astype(np.float32),
                 "input_ids": np.asarray(pipe.prepare_inputs(captions))}
        draws = {"noise": g.standard_normal((rows, *LATENT)).astype(np.float32),
                 "timesteps": g.integers(0, 1000, rows).astype(np.int32),
                 "offset_noise": g.standard_normal((rows, LATENT[0])).astype(np.float32)}
        out.append((batch, draws))
    return out


def torch_updates(steps, k):
    """The same data as the oracle's micro-batches: per update, k (batch, (noise, timesteps, offset)) pairs."""
    batches, draws = [], []
    for batch, d in steps:
        rows = len(batch["latents"]) // k
        cut = lambda x, i: torch.from_numpy(np.array(x[i * rows:(i + 1) * rows]))  # noqa: E731
        batches.append([{name: cut(v, i).long() if name == "input_ids" else cut(v, i) for name, v in batch.items()}
                        for i in range(k)])
        draws.append([(cut(d["noise"], i), cut(d["timesteps"], i).long(),
                       cut(d["offset_noise"], i)[:, :, None, None]) for i in range(k)])
    return batches, draws


def relative(ours, theirs):
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30)


def test_lora_sd1_from_an_initial_lora_matches_the_scripts(sd1, tmp_path):
    """LoRA on SD 1.x's UNet from a given LoRA file (rank 4, alpha 8), with gradient accumulation, noise offset,
    clipping and cosine decay after a warmup."""
    theirs, pipe, params = sd1
    config = TrainConfig(method="lora", learning_rate=3e-3, rank=4, lora_alpha=8, gradient_accumulation_steps=2,
                         noise_offset=0.1, max_grad_norm=0.05, lr_scheduler="cosine", lr_warmup_steps=1,
                         max_train_steps=UPDATES)
    # the initial LoRA: PEFT's names and config, as diffusers' save_lora_weights writes them
    fresh = Trainer(pipe, params, dataclasses.replace(config, init_lora_weights="gaussian"), seed=1)
    g = np.random.default_rng(7)
    initial, tensors = {}, {}
    for name, w in fresh.state.trainable["unet"].items():
        module = torch_name("unet", name.split("/"))
        down, up = np.asarray(w["down"]), 0.2 * g.standard_normal(w["up"].shape).astype(np.float32)
        initial[module] = (down, up)
        tensors[f"unet.{module}.lora_A.weight"], tensors[f"unet.{module}.lora_B.weight"] = down, up
    metadata = {"lora_adapter_metadata": '{"unet.lora_alpha": 8, "unet.r": 4}'}
    write_safetensors(tmp_path / "initial.safetensors", tensors, metadata)

    trainer = Trainer(pipe, params, config, initial_lora=tmp_path / "initial.safetensors")
    steps = data(pipe, rows=4)
    first = float(trainer.loss(steps[0][0], **steps[0][1]))
    ours = [float(trainer.step(batch, **draws)["loss"]) for batch, draws in steps]

    import copy
    unet, text_encoder = copy.deepcopy(theirs.unet), copy.deepcopy(theirs.text_encoder).requires_grad_(False)
    trained = add_peft_lora(unet, config.lora_targets, 4, 8, initial)
    models = {"unet": unet, "text_encoder": text_encoder}
    oracle_first = float(np.mean([oracle_first_loss(models, ddpm(theirs), [(b, d)], config)
                                  for b, d in micro_batches(steps[0], 2)]))
    assert abs(first - oracle_first) <= LOSS_RTOL * abs(oracle_first)
    offset_off = float(np.mean([oracle_first_loss(models, ddpm(theirs), [(b, d)], dataclasses.replace(
        config, noise_offset=0.0)) for b, d in micro_batches(steps[0], 2)]))
    assert abs(offset_off - oracle_first) > 1e-3 * abs(oracle_first)  # the noise offset changes the loss
    losses = train(models, ddpm(theirs), trained, *torch_updates(steps, 2), config)
    np.testing.assert_allclose(ours, losses, rtol=1e-4)
    got = trainer.state.trainable["unet"]
    for module, (down, up) in lora_weights(unet).items():  # started from a LoRA: per tensor, the weights moved
        name = next(n for n in got if torch_name("unet", n.split("/")) == module)
        assert relative(got[name]["down"], down) < WEIGHT_RTOL, module
        assert relative(got[name]["up"], up) < WEIGHT_RTOL, module
    assert max(relative(lora_weights(unet)[m][1], initial[m][1]) for m in initial) > 1e-3

    # the saved LoRA: sdflax's loader gives trainer.params, diffusers' the image of the PEFT-trained UNet
    for format in ("diffusers", "kohya"):
        trainer.save_lora(tmp_path / f"{format}.safetensors", format=format)
        loaded = pipe.load_lora(params, tmp_path / f"{format}.safetensors")
        assert relative(flat(loaded["unet"]), flat(trainer.params["unet"])) < 1e-6, format
    with pytest.raises(FileExistsError, match="exists"):
        trainer.save_lora(tmp_path / "diffusers.safetensors")
    latents = torch.from_numpy(np.random.default_rng(0).standard_normal((1, *LATENT)).astype(np.float32))

    def image(pipeline):
        return pipeline("a red fox", num_inference_steps=2, height=64, width=64, latents=latents.clone(),
                        output_type="np").images

    oracle = copy.deepcopy(theirs)
    oracle.unet = unet
    loaded = copy.deepcopy(theirs)
    loaded.load_lora_weights(str(tmp_path), weight_name="diffusers.safetensors")
    np.testing.assert_allclose(image(loaded), image(oracle), atol=1e-3)
    assert np.abs(image(theirs) - image(oracle)).max() > 1e-3


def micro_batches(step, k):
    """One update's (batch, draws) cut into its k micro-batches."""
    batch, draws = step
    rows = len(batch["latents"]) // k
    return [({n: v[i * rows:(i + 1) * rows] for n, v in batch.items()},
             {n: v[i * rows:(i + 1) * rows] for n, v in draws.items()}) for i in range(k)]


def oracle_first_loss(models, scheduler, steps, config, k=1):
    """The scripts' loss of the first update's first micro-batch under `config`."""
    batches, draws = torch_updates(steps[:1], k)
    with torch.no_grad():
        noise, timesteps, offset = draws[0][0]
        return script_loss(models, scheduler, batches[0][0], noise, timesteps, config, offset).item()


def fresh_lora(trainer, models, initial):
    """PEFT LoRA layers on copies of `models` holding `initial` (the trainer's LoRA before its updates) -> (models,
    their LoRA tensors)."""
    import copy

    models = {name: copy.deepcopy(m).requires_grad_(False) for name, m in models.items()}
    trained = []
    for component, modules in initial.items():
        init = {torch_name(component, n.split("/")): (w["down"], w["up"]) for n, w in modules.items()}
        targets = trainer.lora_targets[component]
        trained += add_peft_lora(models[component], targets, trainer.config.rank, trainer.config.alpha, init)
    return models, trained


def assert_lora_matches(trainer, models):
    """Each model's trained LoRA (all its A and B as one vector) equal to PEFT's at WEIGHT_RTOL. Per tensor, a few
    fresh B (zero at the start) differ more: Adam steps every element by about ±lr whatever its gradient's size, so an
    element whose gradient is float32 rounding in both frameworks can step either way."""
    for component, modules in trainer.state.trainable.items():
        theirs = lora_weights(models[component])
        assert len(theirs) == len(modules)
        pairs = [(w[part], theirs[torch_name(component, name.split("/"))][i]) for name, w in modules.items()
                 for i, part in enumerate(("down", "up"))]
        flat = lambda arrays: np.concatenate([np.ravel(a) for a in arrays])  # noqa: E731
        assert relative(flat(a for a, _ in pairs), flat(b for _, b in pairs)) < WEIGHT_RTOL, component


@pytest.fixture(scope="module")
def sd2_zero_snr(tmp_path_factory):
    """SD 2.x predicting v, its schedule rescaled to zero terminal SNR."""
    folder = tmp_path_factory.mktemp("sd2")
    theirs = torch_pipeline("sd2", scheduler="ddim", prediction_type="v_prediction", rescale_betas_zero_snr=True,
                            timestep_spacing="trailing")
    theirs.save_pretrained(folder)
    return theirs, *StableDiffusion.from_pretrained(folder)


def test_lora_sd2_v_prediction_with_min_snr_and_the_text_encoder(sd2_zero_snr):
    """LoRA on the UNet and the text encoder of a v-predicting SD 2.x with a zero-terminal-SNR schedule, min-SNR-γ
    weighted (γ = 5), linear decay."""
    theirs, pipe, params = sd2_zero_snr
    config = TrainConfig(method="lora", learning_rate=2e-3, rank=2, snr_gamma=5.0, train_text_encoder=True,
                         lr_scheduler="linear", lr_warmup_steps=0, max_train_steps=UPDATES,
                         init_lora_weights="gaussian")
    trainer = Trainer(pipe, params, config, seed=3)
    steps = data(pipe, rows=3, seed=1)
    steps[0][1]["timesteps"][:] = [999, 500, 20]  # zero SNR, the middle, a high SNR that γ clips
    first = float(trainer.loss(*steps[0][:1], **steps[0][1]))
    initial = jax.device_get(trainer.state.trainable)
    ours = [float(trainer.step(batch, **draws)["loss"]) for batch, draws in steps]

    models, trained = fresh_lora(trainer, {"unet": theirs.unet, "text_encoder": theirs.text_encoder}, initial)
    scheduler = ddpm(theirs)
    oracle_first = oracle_first_loss(models, scheduler, steps, config)
    assert abs(first - oracle_first) <= LOSS_RTOL * abs(oracle_first)
    losses = train(models, scheduler, trained, *torch_updates(steps, 1), config)
    np.testing.assert_allclose(ours, losses, rtol=1e-4)
    assert_lora_matches(trainer, models)
    # the settings under test change the oracle
    reference = oracle_first_loss(models, ddpm(theirs), steps, config)  # with the trained LoRA, as the two below
    assert abs(oracle_first_loss(models, ddpm(theirs), steps, dataclasses.replace(config, snr_gamma=None)) -
               reference) > 1e-3 * abs(reference)
    plain = ddpm(theirs)
    plain.register_to_config(rescale_betas_zero_snr=False)
    from diffusers import DDPMScheduler
    plain = DDPMScheduler.from_config(plain.config)
    assert abs(oracle_first_loss(models, plain, steps, config) - reference) > 1e-3 * abs(reference)


def test_dreambooth_prior_preservation_matches_the_script(sd1):
    """DreamBooth (train_dreambooth_lora.py): each micro-batch is [instance rows; class rows], the class rows'
    error added at prior_loss_weight."""
    theirs, pipe, params = sd1
    config = TrainConfig(method="lora", learning_rate=1e-3, rank=2, with_prior_preservation=True,
                         prior_loss_weight=0.5, init_lora_weights="gaussian")
    trainer = Trainer(pipe, params, config, seed=5)
    steps = data(pipe, rows=4, seed=2)
    first = float(trainer.loss(steps[0][0], **steps[0][1]))
    initial = jax.device_get(trainer.state.trainable)
    ours = [float(trainer.step(batch, **draws)["loss"]) for batch, draws in steps]

    models, trained = fresh_lora(trainer, {"unet": theirs.unet, "text_encoder": theirs.text_encoder}, initial)
    oracle_first = oracle_first_loss(models, ddpm(theirs), steps, config)
    assert abs(first - oracle_first) <= LOSS_RTOL * abs(oracle_first)
    losses = train(models, ddpm(theirs), trained, *torch_updates(steps, 1), config)
    np.testing.assert_allclose(ours, losses, rtol=1e-4)
    assert_lora_matches(trainer, models)
    reference = oracle_first_loss(models, ddpm(theirs), steps, config)
    without = oracle_first_loss(models, ddpm(theirs), steps, dataclasses.replace(config, with_prior_preservation=False))
    assert abs(without - reference) > 1e-3 * abs(reference)


def flax_layout(module, torch_model):
    from sdflax.loading.weights import convert_state_dict

    state = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
    return convert_state_dict(state, module.param_shapes())


def flat(tree):
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)])


def test_full_fine_tuning_with_ema_matches_the_script(sd1, tmp_path):
    """Every UNet weight trained (train_text_to_image.py) with EMAModel's averages, linear warmup."""
    import copy

    from diffusers.training_utils import EMAModel

    theirs, pipe, params = sd1
    config = TrainConfig(method="full", learning_rate=1e-3, use_ema=True, lr_scheduler="constant_with_warmup",
                         lr_warmup_steps=2)
    trainer = Trainer(pipe, params, config)
    steps = data(pipe, rows=2, seed=3)
    ours = [float(trainer.step(batch, **draws)["loss"]) for batch, draws in steps]

    unet, text_encoder = copy.deepcopy(theirs.unet), copy.deepcopy(theirs.text_encoder).requires_grad_(False)
    unet.requires_grad_(True)
    ema = EMAModel(unet.parameters(), decay=config.ema_decay)
    losses = train({"unet": unet, "text_encoder": text_encoder}, ddpm(theirs), list(unet.parameters()),
                   *torch_updates(steps, 1), config, ema_model=ema)
    np.testing.assert_allclose(ours, losses, rtol=1e-4)
    start = flat(params["unet"])
    trained = flat(flax_layout(pipe.unet, unet))
    assert relative(flat(trainer.state.trainable["unet"]) - start, trained - start) < WEIGHT_RTOL
    ema.copy_to(unet.parameters())
    averaged = flat(flax_layout(pipe.unet, unet))
    assert relative(flat(trainer.params["unet"]) - start, averaged - start) < WEIGHT_RTOL  # params: the EMA's
    assert relative(averaged - start, trained - start) > 1e-3  # the average is not the last weights

    # the trained pipeline as a diffusers folder: diffusers and sdflax load every weight as trainer.params has it
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    theirs.save_pretrained(tmp_path / "base")
    trainer.save_pretrained(tmp_path / "trained", base=tmp_path / "base")
    with pytest.raises(FileExistsError, match="exists"):
        trainer.save_pretrained(tmp_path / "trained", base=tmp_path / "base")
    expected = jax.device_get(trainer.params)
    for name, cls, module in (("unet", UNet2DConditionModel, pipe.unet), ("vae", AutoencoderKL, pipe.vae),
                              ("text_encoder", CLIPTextModel, pipe.text_encoder)):
        model, info = cls.from_pretrained(tmp_path / "trained" / name, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), (name, info)
        np.testing.assert_array_equal(flat(flax_layout(module, model)), flat(expected[name]), err_msg=name)
    _, reloaded = StableDiffusion.from_pretrained(tmp_path / "trained")
    np.testing.assert_array_equal(flat(reloaded), flat(expected))


def test_textual_inversion_matches_the_script(sd1, tmp_path):
    """textual_inversion.py: a new token starting from the initializer's embedding; only its row changes."""
    import copy

    theirs, pipe, params = sd1
    config = TrainConfig(method="textual_inversion", learning_rate=5e-2, placeholder_token="<cat-toy>",
                         initializer_token="toy", max_grad_norm=None)
    trainer = Trainer(pipe, params, config)
    steps = data(trainer.pipeline, rows=2, seed=4)
    for i, (batch, _) in enumerate(steps):
        batch["input_ids"] = np.asarray(trainer.pipeline.prepare_inputs([f"a photo of a <cat-toy> {i}",
                                                                         "a <cat-toy> on a beach"]))
    ours = [float(trainer.step(batch, **draws)["loss"]) for batch, draws in steps]

    tokenizer = copy.deepcopy(theirs.tokenizer)
    tokenizer.add_tokens(["<cat-toy>"])
    token, initializer = tokenizer.convert_tokens_to_ids(["<cat-toy>", "toy</w>"])
    assert (token,) == tuple(trainer.token_ids["text_encoder"])
    text_encoder, unet = copy.deepcopy(theirs.text_encoder), copy.deepcopy(theirs.unet).requires_grad_(False)
    text_encoder.resize_token_embeddings(len(tokenizer))
    text_encoder.requires_grad_(False)
    weight = text_encoder.get_input_embeddings().weight
    with torch.no_grad():
        weight[token] = weight[initializer]
    weight.requires_grad_(True)
    original = weight.detach().clone()
    losses = train({"unet": unet, "text_encoder": text_encoder}, ddpm(theirs), [weight], *torch_updates(steps, 1),
                   config, restore_rows=(weight, [token], original))
    np.testing.assert_allclose(ours, losses, rtol=1e-4)
    row = trainer.state.trainable["text_encoder"][0]
    assert relative(row - original[token].numpy(), weight[token].detach().numpy() - original[token].numpy()) \
        < WEIGHT_RTOL
    table = np.asarray(trainer.params["text_encoder"]["embeddings_token_embedding"]["embedding"])
    np.testing.assert_array_equal(table[:token], params["text_encoder"]["embeddings_token_embedding"]["embedding"])
    assert relative(row, original[token].numpy()) > 1e-3

    # pictures instead of latents: encoded by the VAE, its posterior sampled as diffusers' latent_dist.sample()
    g = np.random.default_rng(10)
    pixels = np.clip(g.standard_normal((2, 3, 16, 16)), -1, 1).astype(np.float32)  # this VAE halves the side once
    eps = g.standard_normal((2, *LATENT)).astype(np.float32)
    batch, draws = steps[0]
    ours = float(trainer.loss({"pixel_values": pixels, "input_ids": batch["input_ids"]}, latent_noise=eps, **draws))
    with torch.no_grad():
        posterior = theirs.vae.encode(torch.from_numpy(pixels)).latent_dist
        latents = (posterior.mean + posterior.std * torch.from_numpy(eps)) * theirs.vae.config.scaling_factor
    embeds = text_encoder.get_input_embeddings().weight
    with torch.no_grad():
        embeds[token] = torch.from_numpy(np.asarray(row))
    expected = oracle_first_loss({"unet": unet, "text_encoder": text_encoder}, ddpm(theirs),
                                 [(dict(batch, latents=latents.numpy()), draws)], config)
    assert abs(ours - expected) <= LOSS_RTOL * abs(expected)

    # the saved embedding: sdflax and diffusers load the learned row
    trainer.save_embedding(tmp_path / "learned_embeds.safetensors")
    trainer.save_embedding(tmp_path / "cat-toy.safetensors", format="a1111")
    for name, token_name in (("learned_embeds.safetensors", None), ("cat-toy.safetensors", "<cat-toy>")):
        loaded_pipe, loaded = pipe.load_textual_inversion(params, tmp_path / name, token=token_name)
        new_id = loaded_pipe.tokenizer.convert_tokens_to_ids("<cat-toy>")
        np.testing.assert_array_equal(loaded["text_encoder"]["embeddings_token_embedding"]["embedding"][new_id], row)
    reference = copy.deepcopy(theirs)
    reference.load_textual_inversion(str(tmp_path / "learned_embeds.safetensors"))
    new_id = reference.tokenizer.convert_tokens_to_ids("<cat-toy>")
    np.testing.assert_array_equal(reference.text_encoder.get_input_embeddings().weight[new_id].detach().numpy(), row)


def test_lora_sdxl_unet_and_both_text_encoders_matches_the_script(tmp_path_factory):
    """train_text_to_image_lora_sdxl.py: LoRA on the UNet and both text encoders; states of both encoders'
    penultimate layers, the second's pooled embedding and each row's size ids condition the UNet."""
    from builders import torch_xl_pipeline

    from sdflax import StableDiffusionXL

    folder = tmp_path_factory.mktemp("sdxl")
    theirs = torch_xl_pipeline()
    theirs.save_pretrained(folder)
    pipe, params = StableDiffusionXL.from_pretrained(folder)
    config = TrainConfig(method="lora", learning_rate=2e-3, rank=2, train_text_encoder=True,
                         init_lora_weights="gaussian")
    trainer = Trainer(pipe, params, config, seed=2)
    steps = data(pipe, rows=2, seed=5)
    for i, (batch, _) in enumerate(steps):
        batch.update(original_size=np.array([[64, 64], [96, 80]], np.float32) + i,
                     crops_coords_top_left=np.array([[0, 0], [8, 16]], np.float32),
                     target_size=np.array([[64, 64], [64, 64]], np.float32))
    first = float(trainer.loss(steps[0][0], **steps[0][1]))
    initial = jax.device_get(trainer.state.trainable)
    assert sorted(initial) == ["text_encoder", "text_encoder_2", "unet"]
    ours = [float(trainer.step(batch, **draws)["loss"]) for batch, draws in steps]

    models, trained = fresh_lora(trainer, {"unet": theirs.unet, "text_encoder": theirs.text_encoder,
                                           "text_encoder_2": theirs.text_encoder_2}, initial)
    oracle_first = oracle_first_loss(models, ddpm(theirs), steps, config)
    assert abs(first - oracle_first) <= LOSS_RTOL * abs(oracle_first)
    losses = train(models, ddpm(theirs), trained, *torch_updates(steps, 1), config)
    np.testing.assert_allclose(ours, losses, rtol=1e-4)
    assert_lora_matches(trainer, models)
    same_sizes = [(dict(b, original_size=b["target_size"], crops_coords_top_left=0 * b["target_size"]), d)
                  for b, d in steps]
    reference = oracle_first_loss(models, ddpm(theirs), steps, config)
    assert abs(oracle_first_loss(models, ddpm(theirs), same_sizes, config) - reference) > 1e-3 * abs(reference)

    # the merged model as a diffusers folder: the second encoder's projection at the top level, as transformers has it
    from transformers import CLIPTextModelWithProjection

    trainer.save_pretrained(folder / "trained", base=folder)
    encoder, info = CLIPTextModelWithProjection.from_pretrained(folder / "trained" / "text_encoder_2",
                                                                output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    _, reloaded = StableDiffusionXL.from_pretrained(folder / "trained")
    np.testing.assert_array_equal(flat(reloaded), flat(jax.device_get(trainer.params)))


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(sd1, tmp_path):
    """Save after two updates, restore in a fresh process, update once more: the same weights as going on, to the
    bit (the draws come from the saved key; EMA and Adam's moments from the saved state)."""
    import os
    import subprocess
    import sys

    from train_resume_worker import RESUME_CONFIG

    theirs, pipe, params = sd1
    model = tmp_path / "model"
    theirs.save_pretrained(model)
    trainer = Trainer(pipe, params, TrainConfig(**RESUME_CONFIG), seed=11)
    steps = data(pipe, rows=4, seed=6)
    for batch, _ in steps[:2]:
        trainer.step(batch)
    trainer.save_checkpoint(tmp_path / "step-2")
    with pytest.raises(FileExistsError, match="exists"):
        trainer.save_checkpoint(tmp_path / "step-2")
    trainer.step(steps[2][0])
    np.savez(tmp_path / "batch.npz", **steps[2][0])
    subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "train_resume_worker.py"), str(model),
                    str(tmp_path / "step-2"), str(tmp_path / "batch.npz"), str(tmp_path / "out.npz")],
                   check=True, env={**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")})
    resumed = np.load(tmp_path / "out.npz")
    going_on = traverse_util.flatten_dict(jax.device_get(trainer.state.trainable), sep="|")
    assert sorted(resumed.files) == sorted(going_on)
    for name, value in going_on.items():
        np.testing.assert_array_equal(resumed[name], value, err_msg=name)
    assert relative(going_on[next(iter(going_on))], 0 * going_on[next(iter(going_on))]) > 0

    other = Trainer(pipe, params, TrainConfig(**{**RESUME_CONFIG, "rank": 4}), seed=11)
    with pytest.raises(ValueError, match="other settings.*rank"):
        other.restore_checkpoint(tmp_path / "step-2")


@pytest.fixture(scope="module")
def one_device(sd1):
    """Full fine-tuning on one device: three updates of eight rows with given draws -> (steps, trainer), the
    reference of the mesh and the two-process runs."""
    from train_multihost_worker import MULTIHOST_CONFIG

    theirs, pipe, params = sd1
    steps = data(pipe, rows=8, seed=8)
    trainer = Trainer(pipe, params, TrainConfig(**MULTIHOST_CONFIG))
    losses = [float(trainer.step(batch, **draws)["loss"]) for batch, draws in steps]
    assert relative(flat(jax.device_get(trainer.state.trainable)), flat(params["unet"])) > 1e-3  # they moved
    return steps, losses, trainer


def test_a_data_by_fsdp_mesh_trains_as_one_device(sd1, one_device):
    """The same updates on eight devices, a 2 x 4 ("data", "fsdp") mesh (weights and Adam's moments sharded on
    "fsdp", the rows over all eight), with gradient checkpointing: the one-device losses and weights at 1e-5."""
    from jax.sharding import Mesh
    from train_multihost_worker import MULTIHOST_CONFIG

    theirs, pipe, params = sd1
    steps, base_losses, base = one_device
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    trainer = Trainer(pipe, params, TrainConfig(**MULTIHOST_CONFIG, gradient_checkpointing=True), mesh=mesh)
    losses = [float(trainer.step(batch, **draws)["loss"]) for batch, draws in steps]
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    assert relative(flat(jax.device_get(trainer.state.trainable)), flat(jax.device_get(base.state.trainable))) < 1e-5
    kernel = trainer.state.trainable["unet"]["conv_in"]["kernel"]
    assert len({shard.device for shard in kernel.addressable_shards}) == 8
    assert kernel.addressable_shards[0].data.shape[-1] == kernel.shape[-1] // 4  # sharded over "fsdp"
    assert relative(flat(trainer.params["unet"]), flat(base.params["unet"])) < 1e-5


def mixed_precision_run(sd1, precision, rtol, config):
    """Three LoRA updates with the models computing in `precision`: the LoRA and Adam's moments stay float32, the
    frozen weights are in the compute dtype, and the loss and the trained LoRA follow the float32 oracle to `rtol`
    (the compute dtype's precision) -> (trainer, steps)."""
    import copy

    theirs, pipe, params = sd1
    trainer = Trainer(pipe, params, config, seed=9)
    g = np.random.default_rng(9)  # B away from zero, so that the weights are more than Adam's first ±lr steps
    trainer.state = trainer.state.replace(trainable=jax.tree.map(
        lambda x: x + 0.1 * g.standard_normal(x.shape).astype(np.float32), trainer.state.trainable))
    initial = jax.device_get(trainer.state.trainable)
    steps = data(pipe, rows=2, seed=9)
    ours = [float(trainer.step(batch, **draws)["loss"]) for batch, draws in steps]
    assert {x.dtype for x in jax.tree.leaves((trainer.state.trainable, trainer.state.opt_state))} >= {
        np.dtype(np.float32)}
    assert all(x.dtype not in (np.dtype("bfloat16"), np.float16) for x in jax.tree.leaves(trainer.state))
    assert trainer.frozen["unet"]["conv_in"]["kernel"].dtype == np.dtype(precision)

    unet, text_encoder = copy.deepcopy(theirs.unet), copy.deepcopy(theirs.text_encoder).requires_grad_(False)
    init = {torch_name("unet", n.split("/")): (w["down"], w["up"]) for n, w in initial["unet"].items()}
    trained = add_peft_lora(unet, config.lora_targets, 4, 4, init)
    losses = train({"unet": unet, "text_encoder": text_encoder}, ddpm(theirs), trained, *torch_updates(steps, 1),
                   dataclasses.replace(config, mixed_precision="no"))
    np.testing.assert_allclose(ours, losses, rtol=rtol)
    theirs_lora = lora_weights(unet)
    pairs = [(w[part], theirs_lora[torch_name("unet", n.split("/"))][i])
             for n, w in trainer.state.trainable["unet"].items() for i, part in enumerate(("down", "up"))]
    ours_flat, theirs_flat = (np.concatenate([np.ravel(p[i]) for p in pairs]) for i in (0, 1))
    start = np.concatenate([np.ravel(w[part]) for w in initial["unet"].values() for part in ("down", "up")])
    assert relative(ours_flat, theirs_flat) < rtol
    assert relative(theirs_flat, start) > 1e-3  # ... and the updates moved them more than that
    return trainer, steps


def test_bf16_mixed_precision_keeps_float32_weights_and_follows_the_script(sd1):
    """bfloat16 (8 bits of mantissa): 2e-2."""
    config = TrainConfig(method="lora", learning_rate=1e-3, rank=4, mixed_precision="bf16")
    mixed_precision_run(sd1, "bfloat16", 2e-2, config)


def test_fp16_mixed_precision_scales_the_loss_and_skips_an_overflowing_update(sd1):
    """float16 (11 bits of mantissa): 5e-3, under GradScaler's loss scale (2**16 here: no overflow in three
    updates). Then an update whose gradients overflow (the scale set to 2**40) is skipped as accelerate skips it:
    the LoRA and Adam's state unchanged bit for bit, the scale halved, and the learning-rate schedule not advanced
    (the next update runs at the skipped one's rate)."""
    config = TrainConfig(method="lora", learning_rate=1e-3, rank=4, mixed_precision="fp16", lr_scheduler="linear",
                         lr_warmup_steps=0, max_train_steps=10)
    trainer, steps = mixed_precision_run(sd1, "float16", 5e-3, config)
    scale = trainer.state.loss_scale
    assert (float(scale.scale), int(scale.good_steps), int(scale.skipped)) == (2.0 ** 16, 3, 0)

    trainer.state = trainer.state.replace(loss_scale=scale.replace(scale=jnp.float32(2.0 ** 40)))
    before = jax.device_get((trainer.state.trainable, trainer.state.opt_state))
    skipped = trainer.step(*steps[0][:1], **steps[0][1])
    after = jax.device_get((trainer.state.trainable, trainer.state.opt_state))
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    scale = trainer.state.loss_scale
    assert (float(scale.scale), int(scale.good_steps), int(scale.skipped), int(trainer.state.step)) == \
        (2.0 ** 39, 0, 1, 4)
    assert np.isfinite(float(skipped["loss"]))
    trainer.state = trainer.state.replace(loss_scale=scale.replace(scale=jnp.float32(2.0 ** 16)))  # fits again
    applied = trainer.step(*steps[1][:1], **steps[1][1])
    assert int(trainer.state.loss_scale.skipped) == 1
    assert float(applied["learning_rate"]) == float(skipped["learning_rate"]) == pytest.approx(1e-3 * 7 / 10)
    moved = jax.device_get(trainer.state.trainable)
    assert not all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(after[0]), jax.tree.leaves(moved)))


def test_the_fp16_loss_scale_follows_torchs_grad_scaler():
    """LossScale.after against torch's own update (`torch._amp_update_scale_`, what GradScaler.update runs) over
    good and overflowing updates, with a growth interval of 3 so that the scale grows too."""
    scale, tracker = torch.full((), 2.0 ** 16), torch.zeros((), dtype=torch.int32)
    ours = LossScale.initial()
    for found_inf in [0, 0, 0, 1, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0]:
        torch._amp_update_scale_(scale, tracker, torch.full((), float(found_inf)), 2.0, 0.5, 3)
        ours = ours.after(jnp.asarray(not found_inf), growth_interval=3)
        assert (float(ours.scale), int(ours.good_steps)) == (float(scale), int(tracker))
    assert (float(ours.scale), int(ours.skipped)) == (2.0 ** 16, 3)  # three halvings, three doublings


def test_bad_settings_are_refused_in_one_line(sd1):
    theirs, pipe, params = sd1
    cases = [
        (dict(method="dora"), "method='dora' is not one of"),
        (dict(mixed_precision="fp8"), "mixed_precision='fp8' is not one of"),
        (dict(lr_scheduler="cosine"), "give max_train_steps"),
        (dict(learning_rate=float("nan")), "learning_rate=nan must be a finite number"),
        (dict(adam_beta2=1.0), "adam_beta2=1.0 must be a finite number in \\[0.0, 1.0\\)"),
        (dict(rank=0), "rank=0 must be an integer >= 1"),
        (dict(lora_targets="to_q"), "must be a tuple of module names"),
        (dict(method="textual_inversion", placeholder_token="<x>"), "needs placeholder_token .* and initializer"),
        (dict(placeholder_token="<x>"), "are for method='textual_inversion'"),
        (dict(prediction_type="sample"), "prediction_type='sample' is not one of"),
    ]
    for settings, message in cases:
        with pytest.raises(ValueError, match=message):
            TrainConfig(**settings)
    with pytest.raises(ValueError, match="no module of unet matches the LoRA targets"):
        Trainer(pipe, params, TrainConfig(lora_targets=("no_such_layer",)))
    with pytest.raises(ValueError, match="initializer_token 'a red' is 2 tokens"):
        Trainer(pipe, params, TrainConfig(method="textual_inversion", placeholder_token="<y>",
                                          initializer_token="a red"))
    with pytest.raises(ValueError, match="already has '<\\|endoftext\\|>'"):
        Trainer(pipe, params, TrainConfig(method="textual_inversion", placeholder_token="<|endoftext|>",
                                          initializer_token="toy"))
    trainer = Trainer(pipe, params, TrainConfig(gradient_accumulation_steps=2, with_prior_preservation=True))
    batch = data(pipe, rows=4)[0][0]
    with pytest.raises(ValueError, match="latents .* or pixel_values"):
        trainer.step({"input_ids": batch["input_ids"]})
    with pytest.raises(ValueError, match="divide into gradient_accumulation_steps=2"):
        trainer.step({"latents": batch["latents"][:3], "input_ids": batch["input_ids"][:3]})
    with pytest.raises(ValueError, match="an even number of rows; got 1"):
        trainer.step({"latents": batch["latents"][:2], "input_ids": batch["input_ids"][:2]})
    with pytest.raises(ValueError, match="not an embedding"):
        trainer.save_embedding("never-written.safetensors")
    with pytest.raises(FileNotFoundError, match="is not a training checkpoint"):
        trainer.restore_checkpoint("no-such-folder")


def test_two_processes_train_as_one(sd1, one_device, tmp_path):
    """Full fine-tuning by two processes joined with jax.distributed (two CPU devices each, each passing half of
    every batch's rows) against one device with the whole batch: the same weights after three updates; the
    checkpoint the first process writes of the sharded state restores into a one-device trainer."""
    import os
    import socket
    import subprocess
    import sys

    from train_multihost_worker import MULTIHOST_CONFIG

    theirs, pipe, params = sd1
    steps, _, one = one_device
    model = tmp_path / "model"
    theirs.save_pretrained(model)
    np.savez(tmp_path / "data.npz", **{f"{i}.{name}": value for i, (batch, draws) in enumerate(steps)
                                       for name, value in {**batch, **draws}.items()})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = os.path.join(os.path.dirname(__file__), "train_multihost_worker.py")
    processes = [subprocess.Popen([sys.executable, worker, str(port), str(i), str(model), str(tmp_path / "data.npz"),
                                   str(tmp_path / "checkpoint")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for i in range(2)]
    for p in processes:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err.decode()[-3000:]
    joined = Trainer(pipe, params, TrainConfig(**MULTIHOST_CONFIG))
    joined.restore_checkpoint(tmp_path / "checkpoint")
    assert int(joined.state.step) == 3
    assert relative(flat(jax.device_get(joined.state.trainable)), flat(jax.device_get(one.state.trainable))) < 1e-5
