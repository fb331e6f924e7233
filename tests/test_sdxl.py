"""Stable Diffusion XL: the UNet and second text encoder against diffusers / transformers, the pipeline against
diffusers' StableDiffusionXLPipeline (PyTorch), the pmap and sharded paths, bfloat16 and the force_upcast VAE."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from builders import SDXL, saved, torch_text_encoder_2, torch_unet, torch_xl_pipeline

import jax
import jax.numpy as jnp

from sdflax import CLIPTextModel, CLIPTextModelWithProjection, StableDiffusionXL, UNet2DConditionModel
from sdflax import replicate, shard, unshard
from sdflax.models import AutoencoderKL
from sdflax.pipeline.vae import VAE
from sdflax.loading.weights import CheckpointMismatchError

RTOL, ATOL = 1e-4, 1e-5  # float32 module parity
IMAGE_ATOL = 1e-3  # images in [0, 1], float32
STEPS = 3
PROMPTS = ["a photo of an astronaut riding a horse on mars", "a watercolor of a lighthouse"]
NEGATIVE = ["blurry", "low quality, dark"]
SIZES = dict(original_size=(64, 48), crops_coords_top_left=(4, 8), target_size=(40, 32))


def assert_close(ours, theirs, rtol=RTOL, atol=ATOL):
    np.testing.assert_allclose(np.asarray(ours, np.float32), theirs.detach().float().numpy(), rtol=rtol, atol=atol)


# ---- models ---------------------------------------------------------------------------------------------------
def test_unet_matches_diffusers(tmp_path):
    theirs = torch_unet(SDXL["unet"])
    theirs.save_pretrained(tmp_path / "unet", safe_serialization=True)
    unet, params = UNet2DConditionModel.from_pretrained(tmp_path / "unet")
    assert unet.config.heads == (2, 4) and unet.config.transformer_layers_per_block == (1, 2)
    assert "down_blocks_0_attentions_0" not in params and "up_blocks_0_attentions_2" in params
    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, 16, 16), dtype=np.float32)
    context = rng.standard_normal((2, 77, 64), dtype=np.float32)
    text_embeds = rng.standard_normal((2, 32), dtype=np.float32)
    time_ids = np.array([[1024, 1024, 0, 0, 1024, 1024], [512, 768, 16, 32, 480, 640]], np.float32)
    apply = jax.jit(unet.apply)
    for timesteps in ([1, 999], [500, 37]):
        t = np.array(timesteps)
        ours = apply(params, sample, t, context, text_embeds=text_embeds, time_ids=time_ids)
        with torch.no_grad():
            expected = theirs(torch.from_numpy(sample), torch.from_numpy(t), torch.from_numpy(context),
                              added_cond_kwargs={"text_embeds": torch.from_numpy(text_embeds),
                                                 "time_ids": torch.from_numpy(time_ids)}).sample
        assert ours.shape == (2, 4, 16, 16)
        assert_close(ours, expected)
    # the micro-conditioning reaches the output
    other = apply(params, sample, np.array([500, 37]), context, text_embeds=text_embeds, time_ids=time_ids[::-1])
    assert np.abs(np.asarray(other) - np.asarray(ours)).max() > 1e-3

    with pytest.raises(ValueError, match="needs text_embeds"):  # raised while tracing: shapes suffice
        jax.eval_shape(unet.apply, params, sample, 1, context)
    with pytest.raises(ValueError, match="projection_class_embeddings_input_dim=80"):
        jax.eval_shape(functools.partial(unet.apply, text_embeds=text_embeds, time_ids=time_ids[:, :5]), params,
                       sample, 1, context)


def test_unet_config_rejects_what_it_cannot_compute():
    with pytest.raises(ValueError, match="addition_embed_type='text'"):
        UNet2DConditionModel.from_config({**SDXL["unet"], "addition_embed_type": "text"})
    with pytest.raises(ValueError, match="needs addition_time_embed_dim"):
        UNet2DConditionModel.from_config({**SDXL["unet"], "addition_time_embed_dim": None})
    with pytest.raises(ValueError, match="per layer"):
        UNet2DConditionModel.from_config({**SDXL["unet"], "transformer_layers_per_block": [[1, 1], [2, 2]]})
    sd = UNet2DConditionModel.from_config({k: v for k, v in SDXL["unet"].items() if "addition" not in k})
    with pytest.raises(ValueError, match="no addition_embed_type"):  # raised while tracing: shapes suffice
        jax.eval_shape(functools.partial(sd.apply, text_embeds=np.zeros((1, 32))), sd.param_shapes(),
                       np.zeros((1, 4, 8, 8)), 1, np.zeros((1, 77, 64)))


# stabilityai/stable-diffusion-xl-base-1.0's unet/config.json: the fields that shape the network
SDXL_BASE_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(320, 640, 1280),
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(5, 10, 20),
    transformer_layers_per_block=(1, 2, 10), cross_attention_dim=2048, use_linear_projection=True,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
)


def test_full_size_sdxl_unet_has_the_tensors_of_diffusers():
    """Every tensor of diffusers' SDXL base UNet (on the meta device: shapes, no weights) finds our parameter of
    its size, and nothing is left over: 2.57 B parameters, no download."""
    from diffusers import UNet2DConditionModel as TorchUNet
    from flax import traverse_util

    from sdflax.loading.weights import WEIGHT_LEAVES, _module_and_leaf

    with torch.device("meta"):
        theirs = {k: v.shape.numel() for k, v in TorchUNet(**SDXL_BASE_UNET).state_dict().items()}
    ours = traverse_util.flatten_dict(UNet2DConditionModel.from_config(SDXL_BASE_UNET).param_shapes())
    sizes = {("_".join(path[:-1]), path[-1]): int(np.prod(leaf.shape)) for path, leaf in ours.items()}
    matched = {}
    for key, size in theirs.items():
        module, leaf = _module_and_leaf(key)
        leaf = next((t for t in WEIGHT_LEAVES if (module, t) in sizes), leaf) if leaf == "weight" else leaf
        matched[key] = sizes.get((module, leaf))
    assert {k: v for k, v in matched.items() if v != theirs[k]} == {}
    assert len(ours) == len(theirs) == 1680 and sum(sizes.values()) == sum(theirs.values()) == 2_567_463_684


@pytest.mark.parametrize("eos_token_id", [2, 49407])  # SDXL's legacy id (pool at the largest id), and the fixed one
def test_text_encoder_with_projection_matches_transformers(tmp_path, eos_token_id):
    config = {**SDXL["text_encoder_2"], "eos_token_id": eos_token_id}
    theirs = torch_text_encoder_2(config)
    theirs.save_pretrained(tmp_path / "text_encoder_2")
    clip, params = CLIPTextModelWithProjection.from_pretrained(tmp_path / "text_encoder_2")
    ids = np.zeros((2, 77), np.int64)  # padded with "!" (0), as SDXL's second tokenizer does
    ids[0, :6] = [49406, 5, 17, 30000, 42, 49407]
    ids[1, :3] = [49406, 7, 49407]
    with torch.no_grad():
        expected = theirs(torch.from_numpy(ids), output_hidden_states=True)
    ours = jax.jit(functools.partial(clip.apply, output_hidden_states=True))(params, ids)
    assert ours.text_embeds.shape == (2, config["projection_dim"])
    assert_close(ours.text_embeds, expected.text_embeds)
    assert_close(ours.last_hidden_state, expected.last_hidden_state)
    assert len(ours.hidden_states) == config["num_hidden_layers"] + 1
    for mine, theirs_h in zip(ours.hidden_states, expected.hidden_states):
        assert_close(mine, theirs_h)
    # a projection checkpoint is not a plain CLIPTextModel: the loader names the tensor it cannot place
    with pytest.raises(CheckpointMismatchError, match="not used by the model: text_projection.weight"):
        CLIPTextModel.from_pretrained(tmp_path / "text_encoder_2")


# ---- pipeline parity ------------------------------------------------------------------------------------------
def latents_for(pipe, batch=2):
    size = pipe.unet.config.sample_size
    return np.random.default_rng(0).standard_normal((batch, 4, size, size), dtype=np.float32)


@pytest.fixture(scope="module")
def euler(tmp_path_factory):
    """(diffusers pipeline, our pipeline, params) on one saved checkpoint with SDXL's Euler scheduler."""
    return saved(torch_xl_pipeline("euler"), tmp_path_factory.mktemp("sdxl"), StableDiffusionXL)


def torch_images(theirs, latents, guidance=5.0, **kwargs):
    with torch.no_grad():
        return theirs(PROMPTS, guidance_scale=guidance, num_inference_steps=STEPS, latents=torch.from_numpy(latents),
                      output_type="np", **kwargs).images


def check_images(ours, expected):
    assert ours.shape == expected.shape == (2, 32, 32, 3)
    assert ours.dtype == np.float32 and 0 <= ours.min() and ours.max() <= 1
    assert expected.std() > 0.05  # not a blank image: the comparison means something
    np.testing.assert_allclose(ours, expected, rtol=0, atol=IMAGE_ATOL)


def test_loads_both_encoders_and_tokenizers(euler):
    theirs, pipe, params = euler
    assert set(params) == {"text_encoder", "text_encoder_2", "unet", "vae"}
    assert type(pipe.scheduler).__name__ == "EulerScheduler" and pipe.force_zeros_for_empty_prompt
    ids = pipe.prepare_inputs(PROMPTS)
    assert ids.shape == (2, 2, 77) and ids.dtype == np.int32
    for row, tokenizer in enumerate((theirs.tokenizer, theirs.tokenizer_2)):
        expected = tokenizer(PROMPTS, padding="max_length", max_length=77, truncation=True, return_tensors="np")
        np.testing.assert_array_equal(ids[:, row], expected.input_ids)
    assert ids[1, 0, -1] == 49407 and ids[1, 1, -1] == 0  # the end token pads the first, "!" the second
    with pytest.raises(ValueError, match=r"expected \(batch, 2, 77\)"):
        pipe(ids[:, 0], params, jax.random.key(0), STEPS)


def compile_events() -> list:
    """The XLA compiles of this process from now on, as they happen."""
    events = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, *_, **__: events.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    return events


def test_images_match_diffusers_with_and_without_negative_prompt_in_one_program(euler):
    theirs, pipe, params = euler
    latents = latents_for(pipe)
    ids = pipe.prepare_inputs(PROMPTS)
    compiles = compile_events()
    # No negative prompt and force_zeros_for_empty_prompt: zero unconditional embeddings.
    plain = pipe(ids, params, jax.random.key(0), STEPS, latents=latents).images
    check_images(plain, torch_images(theirs, latents))
    before, programs = len(compiles), pipe._jitted._cache_size()
    # A negative prompt: the same program (which rows get zeros is chosen in it).
    negative = pipe(ids, params, jax.random.key(0), STEPS, guidance_scale=5.0, latents=latents,
                    neg_prompt_ids=pipe.prepare_inputs(NEGATIVE)).images
    check_images(negative, torch_images(theirs, latents, negative_prompt=NEGATIVE))
    # Non-default size / crop micro-conditioning and guidance_rescale: traced, the same program too.
    sized = pipe(ids, params, jax.random.key(0), STEPS, latents=latents, guidance_rescale=0.7, **SIZES).images
    check_images(sized, torch_images(theirs, latents, guidance_rescale=0.7, **SIZES))
    assert np.abs(sized - plain).max() > 1e-2
    assert len(compiles) == before and pipe._jitted._cache_size() == programs


def test_images_match_diffusers_without_zeros_for_empty_prompt(euler, tmp_path):
    theirs = torch_xl_pipeline("euler", force_zeros_for_empty_prompt=False)
    theirs.save_pretrained(tmp_path)
    pipe, params = StableDiffusionXL.from_pretrained(tmp_path)
    assert not pipe.force_zeros_for_empty_prompt  # read from model_index.json
    latents = latents_for(pipe)
    ids = pipe.prepare_inputs(PROMPTS)
    ours = pipe(ids, params, jax.random.key(0), STEPS, guidance_scale=6.0, latents=latents).images
    expected = torch_images(theirs, latents, guidance=6.0)
    check_images(ours, expected)  # the empty prompt, encoded
    # An empty negative prompt given is encoded with force_zeros_for_empty_prompt too (diffusers zeros a missing
    # one only): the checkpoint that forces zeros has the same weights.
    _, zeros, zeros_params = euler
    empty = zeros(ids, zeros_params, jax.random.key(0), STEPS, guidance_scale=6.0, latents=latents,
                  neg_prompt_ids=zeros.prepare_inputs(["", ""])).images
    check_images(empty, expected)


def test_images_match_diffusers_dpm_solver(tmp_path):
    theirs = torch_xl_pipeline("dpmpp_2m")
    theirs.save_pretrained(tmp_path)
    pipe, params = StableDiffusionXL.from_pretrained(tmp_path)
    assert type(pipe.scheduler).__name__ == "DPMSolverScheduler"
    latents = latents_for(pipe)
    ours = pipe(pipe.prepare_inputs(PROMPTS), params, jax.random.key(0), STEPS, guidance_scale=7.0, latents=latents,
                neg_prompt_ids=pipe.prepare_inputs(NEGATIVE)).images
    check_images(ours, torch_images(theirs, latents, guidance=7.0, negative_prompt=NEGATIVE))


# ---- devices --------------------------------------------------------------------------------------------------
def test_pmap_and_sharded_paths_equal_single_device_calls(euler):
    """Two images per device from given latents: a device's images are what a one-device call on its rows gives
    (the static settings of the parity test's call without a negative prompt: its program)."""
    _, pipe, params = euler
    devices = jax.local_device_count()
    assert devices == 8
    things = ("cat", "dog", "ship", "tree", "house", "hill", "river", "city")
    prompts = [f"a {style} of a {thing}" for thing in things for style in ("painting", "photo")]
    ids = pipe.prepare_inputs(prompts)
    latents = latents_for(pipe, 2 * devices)
    rng = jax.random.split(jax.random.key(0), devices)
    images = pipe(shard(ids), replicate(params), rng, STEPS, jit=True, latents=shard(latents),
                  original_size=(48, 40)).images
    assert images.shape == (8, 2, 32, 32, 3)
    for i in (0, 5):
        rows = slice(2 * i, 2 * i + 2)
        single = pipe(ids[rows], params, rng[i], STEPS, latents=latents[rows], original_size=(48, 40)).images
        np.testing.assert_allclose(images[i], single, rtol=0, atol=1e-5)
    assert np.abs(images[0] - images[1]).max() > 1e-3
    sharded = pipe.generate_sharded(ids, params, rng, STEPS, latents=latents, original_size=(48, 40))
    assert sharded.shape == (16, 32, 32, 3)
    np.testing.assert_allclose(sharded, unshard(images), rtol=0, atol=1e-5)


# ---- precision ------------------------------------------------------------------------------------------------
def walk(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it (jit, custom calls)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from walk(inner)


def conv_dtypes(fn, *args):
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    return {eqn.outvars[0].aval.dtype for eqn in walk(jaxpr) if eqn.primitive.name == "conv_general_dilated"}


def test_bfloat16_runs_and_only_a_float16_vae_decodes_in_float32(euler, tmp_path):
    """force_upcast as diffusers' SDXL pipelines read it at the decode (`needs_upcasting`): a float16 VAE decodes
    in float32, a bfloat16 one (float32's range: it does not overflow) in bfloat16."""
    theirs, pipe32, params32 = euler
    theirs.save_pretrained(tmp_path)
    pipe, params = StableDiffusionXL.from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    assert pipe.vae.config.force_upcast

    latents = latents_for(pipe, 1)
    scaled = jnp.asarray(latents) * pipe.vae.config.scaling_factor
    to_images = lambda x: np.clip(np.asarray(x, np.float32) / 2 + 0.5, 0, 1).transpose(0, 2, 3, 1)  # noqa: E731
    upcast = lambda p: jax.tree.map(lambda w: w.astype(jnp.float32), p)  # noqa: E731
    vae32 = AutoencoderKL(pipe.vae.config, jnp.float32)
    decode32 = jax.jit(lambda p, x: vae32.apply(upcast(p), x, method="decode"))

    # bfloat16: every VAE conv of the decode in bfloat16, the VAE's own program ...
    assert conv_dtypes(pipe.decode_latents, params, scaled) == {jnp.dtype(jnp.bfloat16)}
    ours = jax.jit(pipe.decode_latents)(params, scaled)
    alone = to_images(jax.jit(lambda p, x: pipe.vae.apply(p["vae"], x, method="decode"))(params, latents))
    np.testing.assert_allclose(ours, alone, rtol=0, atol=1e-6)
    float32_decode = to_images(decode32(params["vae"], latents))
    assert np.abs(ours - float32_decode).max() > 1e-4  # (which a float32 decode is not)

    # ... float16: every conv in float32, on the float16 weights cast inside the program
    vae16 = AutoencoderKL(pipe.vae.config, jnp.float16)
    params16 = {"vae": jax.tree.map(lambda w: w.astype(jnp.float16), params["vae"])}
    decode16 = VAE(vae16, in_float32=True).decode
    assert conv_dtypes(decode16, params16, scaled) == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(jax.jit(decode16)(params16, scaled), to_images(decode32(params16["vae"], latents)),
                               rtol=0, atol=1e-5)

    # ... and the whole bfloat16 pipeline stays near the float32 one (8 mantissa bits over 3 steps).
    ids = pipe.prepare_inputs(PROMPTS)
    half = pipe(ids, params, jax.random.key(0), STEPS, latents=latents_for(pipe)).images
    full = pipe32(ids, params32, jax.random.key(0), STEPS, latents=latents_for(pipe)).images
    assert half.dtype == np.float32 and np.isfinite(half).all()
    assert np.abs(half - full).max() < 0.05, np.abs(half - full).max()
