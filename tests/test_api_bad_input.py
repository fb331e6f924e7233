"""Bad arguments to the Python API: each is one clear ValueError / TypeError that names the argument, raised by the
pipeline's checks before anything is traced (none of these calls compiles), instead of a raw jax error, a
KeyError, or a run that broadcasts the mistake into a garbage image."""

import json
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file as read_safetensors_file, save_file
from test_cli import TINY

import sdflax
from sdflax.loading.files import CheckpointFileError
from sdflax.loading.lora import LoraMismatchError


@pytest.fixture(scope="module")
def tiny():
    pipe, params = sdflax.StableDiffusion.from_pretrained(TINY)
    return pipe, params, pipe.prepare_inputs(["a fox"])


def refused(error_type, call, *needles):
    with pytest.raises(error_type) as info:
        call()
    message = str(info.value)
    assert "\n" not in message, message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("name, value", [("height", 0), ("height", -64), ("width", -8), ("width", 64.0),
                                         ("height", True), ("width", "64")])
def test_sizes_must_be_positive_whole_numbers(tiny, name, value):
    pipe, params, ids = tiny
    refused(ValueError, lambda: pipe(ids, params, jax.random.PRNGKey(0), 2, **{name: value}),
            f"{name} must be a positive whole number of pixels", repr(value))


@pytest.mark.parametrize("key, expected", [
    (0, "got 0"), ([0, 1], "got [0, 1]"), (np.zeros(2, np.float32), "got a float32 array of shape (2,)"),
    (np.zeros(3, np.uint32), "got a uint32 array of shape (3,)"),
])
def test_prng_seed_must_be_a_key(tiny, key, expected):
    pipe, params, ids = tiny
    refused(TypeError, lambda: pipe(ids, params, key, 2),
            "prng_seed must be a PRNG key (jax.random.PRNGKey(seed) or jax.random.key(seed))", expected)


def test_prng_seed_shapes(tiny):
    pipe, params, ids = tiny
    keys = jax.random.split(jax.random.PRNGKey(0), 4).reshape(2, 2, 2)
    refused(ValueError, lambda: pipe(ids, params, keys, 2), "prng_seed has shape (2, 2, 2): give one key, or one "
            "key per image")
    refused(ValueError, lambda: pipe(np.repeat(ids, 2, 0), params, jax.random.split(jax.random.PRNGKey(0), 3), 2),
            "3 PRNG keys for a batch of 2")
    ids, params = sdflax.shard(np.repeat(ids, jax.local_device_count(), 0)), sdflax.replicate(params)
    refused(ValueError, lambda: pipe(ids, params, jax.random.PRNGKey(0), 2, jit=True),
            "prng_seed has shape (2,): jit=True needs one key per device, jax.random.split(key, "
            "jax.local_device_count())")


def test_params_must_hold_every_model_and_match_the_mode(tiny):
    pipe, params, ids = tiny
    key = jax.random.PRNGKey(0)
    refused(ValueError, lambda: pipe(ids, {"text_encoder": params["text_encoder"], "vae": params["vae"]}, key, 2),
            "params has no 'unet' (it has 'text_encoder', 'vae'): pass the params from StableDiffusion.from_pretrained")
    refused(ValueError, lambda: pipe._generate(ids, {"unet": params["unet"]}, key, 2), "params has no "
            "'text_encoder', 'vae'")
    refused(TypeError, lambda: pipe(ids, [params], key, 2), "params must be the dict from from_pretrained "
            "(text_encoder, unet, vae), got list")

    devices = jax.local_device_count()
    replicated, keys = sdflax.replicate(params), jax.random.split(key, devices)
    refused(ValueError, lambda: pipe(ids, replicated, key, 2), "params are replicated (a leading device axis), but "
            "jit=False takes them as from_pretrained gives them")
    refused(ValueError, lambda: pipe.generate_sharded(np.repeat(ids, devices, 0), replicated, keys, 2),
            "but generate_sharded takes them as from_pretrained gives them")
    sharded = sdflax.shard(np.repeat(ids, devices, 0))
    refused(ValueError, lambda: pipe(sharded, params, keys, 2, jit=True), "jit=True runs under pmap and needs "
            "replicated params: sdflax.replicate(params)")


def test_token_ids_must_be_integers_of_the_vocabulary(tiny):
    pipe, params, ids = tiny
    key = jax.random.PRNGKey(0)
    refused(TypeError, lambda: pipe(ids.astype(np.float32), params, key, 2), "prompt_ids must be integer token ids "
            "(pipeline.prepare_inputs(prompts)), got float32")
    vocab = pipe.text_encoder.config.vocab_size
    refused(ValueError, lambda: pipe(ids, params, key, 2, neg_prompt_ids=ids + vocab), f"neg_prompt_ids holds token "
            f"id {ids.max() + vocab}, outside the text encoder's vocabulary [0, {vocab})")
    refused(ValueError, lambda: pipe(ids - vocab, params, key, 2), f"token id {ids.min() - vocab}, outside")


@pytest.mark.parametrize("name, value, expected", [
    ("guidance_scale", jnp.ones(3), "guidance_scale must be one number, got an array of shape (3,)"),
    ("guidance_scale", np.ones((1, 1)), "guidance_scale must be one number, got an array of shape (1, 1)"),
    ("guidance_scale", float("nan"), "guidance_scale must be a finite number, got nan"),
    ("guidance_scale", float("inf"), "guidance_scale must be a finite number, got inf"),
    ("guidance_rescale", float("nan"), "guidance_rescale must be a finite number, got nan"),
])
def test_scales_must_be_one_finite_number(tiny, name, value, expected):
    pipe, params, ids = tiny
    refused(ValueError, lambda: pipe(ids, params, jax.random.PRNGKey(0), 2, **{name: value}), expected)


@pytest.mark.parametrize("name, value, needs", [
    ("ip_adapter_scale", 0.5, "an IP-Adapter"), ("ip_adapter_scale", {"up": {"block_0": [1.0]}}, "an IP-Adapter"),
    ("ip_adapter_masks", [np.ones((1, 1, 8, 8), np.float32)], "an IP-Adapter"),
    ("adapter_conditioning_scale", 0.5, "T2I-Adapters"), ("adapter_conditioning_factor", 0.5, "T2I-Adapters"),
    ("adapter_image", np.zeros((1, 3, 64, 64), np.float32), "T2I-Adapters"),
])
def test_adapter_arguments_without_the_adapter_are_refused(tiny, name, value, needs):
    """They did nothing, silently (a PNG or a log would record them)."""
    pipe, params, ids = tiny
    refused(ValueError, lambda: pipe(ids, params, jax.random.PRNGKey(0), 2, **{name: value}),
            f"{name} applies with {needs}", f"or drop {name}")
    pipe(ids, params, jax.random.PRNGKey(0), 2, **{name: 1.0 if "scale" in name or "factor" in name else None})


# --- LoRA files whose metadata or tensors would merge into garbage -----------------------------------------------

LAYER = "lora_unet_down_blocks_0_attentions_0_proj_in"


def lora_file(path, params, rank=2, alpha=None, metadata=None):
    width = params["unet"]["down_blocks_0_attentions_0"]["proj_in"]["kernel"].shape[-2]
    tensors = {f"{LAYER}.lora_down.weight": np.ones((rank, width), np.float32),
               f"{LAYER}.lora_up.weight": np.ones((width, rank), np.float32)}
    if alpha is not None:
        tensors[f"{LAYER}.alpha"] = np.asarray(alpha, np.float32)
    save_file(tensors, path, metadata=metadata)
    return path


def test_lora_metadata_that_is_not_a_lora_config(tiny, tmp_path):
    pipe, params, _ = tiny
    for raw in ["[1, 2]", "{not json", json.dumps({"unet.lora_alpha": "high"}),
                json.dumps({"unet.lora_alpha": 4, "unet.alpha_pattern": [1]})]:
        path = lora_file(tmp_path / "meta.safetensors", params, metadata={"lora_adapter_metadata": raw})
        refused(LoraMismatchError, lambda: pipe.load_lora(params, path), f"LoRA file {path}: its "
                "lora_adapter_metadata is not a diffusers LoRA config")


def test_lora_values_that_would_merge_into_a_black_image(tiny, tmp_path):
    """NaN weights, a metadata alpha of 1e999 or NaN, a scale that is inf in float32: exit 0 and a black image
    before; a 0-d lora_down was an IndexError."""
    pipe, params, _ = tiny
    path = lora_file(tmp_path / "nan.safetensors", params)
    tensors = {k: v.copy() for k, v in read_safetensors_file(path).items()}
    tensors[f"{LAYER}.lora_up.weight"][0, 0] = np.nan
    save_file(tensors, path)
    refused(LoraMismatchError, lambda: pipe.load_lora(params, path), f"LoRA file {path} does not fit this pipeline: "
            f"values that are not finite (NaN or inf): {LAYER}.lora_up.weight")
    for alpha in ("1e999", "NaN"):
        raw = f'{{"unet.lora_alpha": {alpha}}}'
        path = lora_file(tmp_path / "alpha.safetensors", params, metadata={"lora_adapter_metadata": raw})
        refused(LoraMismatchError, lambda: pipe.load_lora(params, path), "its lora_adapter_metadata is not a "
                "diffusers LoRA config (unet: lora_alpha and alpha_pattern values must be finite numbers)")
    path = lora_file(tmp_path / "ok.safetensors", params)
    for scale in (1e39, float("nan")):
        refused(ValueError, lambda: pipe.load_lora(params, path, scale), "LoRA scale must be a finite float32 "
                f"number (1 is the LoRA's full strength, 0 leaves the model as it is), got {scale}")
    tensors = {k: v.copy() for k, v in read_safetensors_file(path).items()}
    tensors[f"{LAYER}.lora_down.weight"] = np.array(1.0, np.float32)
    save_file(tensors, path)
    refused(LoraMismatchError, lambda: pipe.load_lora(params, path), f"{LAYER}.lora_down.weight: down () and up")


@pytest.mark.parametrize("key", ["(", "(.*.*.*.*)*z", "proj_in|to_q", "x" * 300])
def test_lora_alpha_pattern_keys_are_module_names_never_run_as_regexes(tiny, tmp_path, key):
    """A file's pattern is not handed to the regex engine: "(" was a re.error traceback, "(.*.*.*.*)*z" ran past
    300 s."""
    pipe, params, _ = tiny
    raw = json.dumps({"unet.lora_alpha": 4, "unet.alpha_pattern": {"down_blocks.0.attentions.0.proj_in": 2,
                                                                   key: 8}})
    path = lora_file(tmp_path / "meta.safetensors", params, metadata={"lora_adapter_metadata": raw})
    refused(LoraMismatchError, lambda: pipe.load_lora(params, path), f"LoRA file {path}: its lora_adapter_metadata "
            f"is not a diffusers LoRA config (unet.alpha_pattern key {key[:60]!r} is not a module name")


def test_safetensors_metadata_must_map_strings_to_strings(tiny, tmp_path):
    pipe, params, _ = tiny
    header = json.dumps({"__metadata__": [1, 2]}).encode()
    path = tmp_path / "list-metadata.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    refused(CheckpointFileError, lambda: pipe.load_lora(params, path), "__metadata__ must map strings to strings")


def test_rank_zero_and_non_finite_alpha_are_refused(tiny, tmp_path):
    pipe, params, _ = tiny
    path = lora_file(tmp_path / "rank0.safetensors", params, rank=0)
    refused(LoraMismatchError, lambda: pipe.load_lora(params, path), f"{LAYER}.lora_down.weight: rank 0")
    for alpha in (float("nan"), [1.0, 2.0]):
        path = lora_file(tmp_path / "alpha.safetensors", params, alpha=alpha)
        refused(LoraMismatchError, lambda: pipe.load_lora(params, path), f"{LAYER}.alpha: alpha must be one finite "
                "number")
    merged = pipe.load_lora(params, lora_file(tmp_path / "good.safetensors", params, alpha=1.0))  # the control
    delta = merged["unet"]["down_blocks_0_attentions_0"]["proj_in"]["kernel"] - \
        params["unet"]["down_blocks_0_attentions_0"]["proj_in"]["kernel"]
    np.testing.assert_allclose(np.asarray(delta).reshape(-1)[:4], 2 * 0.5, rtol=1e-6)  # up @ down = rank, x alpha/rank


# --- hooks ---------------------------------------------------------------------------------------------------------

def test_hook_settings_that_would_do_nothing_or_garbage(tiny):
    """freeu(nan) made NaN images; a PAG pattern "(" was a re.error; deep_cache(branch=99) ran as if absent."""
    from sdflax.hooks import deep_cache, freeu, perturbed_attention_guidance

    refused(ValueError, lambda: freeu(float("nan"), 0.2, 1.1, 1.2), "freeu: s1 must be a finite number, got nan")
    refused(ValueError, lambda: perturbed_attention_guidance(3.0, "("), "pag_applied_layers: '(' is not a regular "
            "expression (missing ), unterminated subpattern at position 0); give layer names such as 'mid'")
    pipe, params, ids = tiny
    skips = len(pipe.unet.config.up_block_types) * (pipe.unet.config.layers_per_block + 1)
    refused(ValueError, lambda: pipe.with_hooks(deep_cache(branch=99))(ids, params, jax.random.key(0), 2),
            f"branch 99: this UNet's skip connections are 0 to {skips - 1} (DeepCache's branch names one)")


def test_hook_layer_names_the_unet_lacks_are_refused(tiny):
    """PAG on ["nope"] equalled no hook; cross_attention_maps(layers=["nope"]) returned no maps: names are checked
    against the layers the UNet calls the hook at, once it is traced."""
    from sdflax.hooks import cross_attention_maps, perturbed_attention_guidance

    pipe, params, ids = tiny
    run = lambda hook: pipe.with_hooks(hook)(ids, params, jax.random.key(0), 2)  # noqa: E731
    refused(ValueError, lambda: run(perturbed_attention_guidance(3.0, ["mid", "nope"])), "pag_applied_layers: "
            "'nope' matches no self-attention layer of this UNet: give a part of their names, e.g. 'mid' or one of "
            "down_blocks.0.attentions.0, down_blocks.1.attentions.0, mid_block.attentions.0, up_blocks.1.attentions.0, "
            "up_blocks.1.attentions.1, up_blocks.2.attentions.0, up_blocks.2.attentions.1")
    refused(ValueError, lambda: run(cross_attention_maps(layers=["mid_block.attentions.0.transformer_blocks.0.attn1"])),
            "cross_attention_maps: layers 'mid_block.attentions.0.transformer_blocks.0.attn1' is not a "
            "cross-attention layer of this UNet: give their full names: down_blocks.0.attentions.0.transformer_blocks"
            ".0.attn2, down_blocks.1.attentions.0.transformer_blocks.0.attn2, mid_block.attentions.0.transformer_"
            "blocks.0.attn2, ... (7 in all)")


# --- arguments of the wrong kind, which failed deep inside ------------------------------------------------------

@pytest.mark.parametrize("call, error, expected", [
    (lambda p, params, ids: p(ids.tolist(), params, jax.random.key(0), 2), TypeError,
     "prompt_ids must be an array (numpy or jax), got a list: make it with pipeline.prepare_inputs(prompts)"),
    (lambda p, params, ids: p(ids, params, jax.random.key(0), 2, latents=np.zeros((1, 4, 8, 8)).tolist()),
     TypeError, "latents must be an array (numpy or jax), got a list"),
    (lambda p, params, ids: p(ids, params, jax.random.key(0), 2, guidance_scale="7.5"), TypeError,
     "guidance_scale must be a number, got '7.5' (str)"),
    (lambda p, params, ids: p(ids, params, jax.random.key(0), 2, guidance_scale=None), TypeError,
     "guidance_scale must be a number, got None (NoneType)"),
    (lambda p, params, ids: p(ids[:0], params, jax.random.key(0), 2), ValueError,
     "prompt_ids of shape (0, 77) holds no prompt: give at least one"),
    (lambda p, params, ids: p.prepare_inputs(None), TypeError, "prompts must be a string or a list of strings, got "
     "None"),
    (lambda p, params, ids: p(None, params, jax.random.key(0), 2, prompt_embeds=np.zeros((1, 77, 7), np.float32)),
     ValueError, "prompt_embeds has shape (1, 77, 7); the UNet takes text states 32 wide"),
    (lambda p, params, ids: p(ids, {**params, "unet": {k: v for k, v in params["unet"].items() if k != "conv_in"}},
                              jax.random.key(0), 2), ValueError,
     'params lack a parameter a model reads (Could not find parameter named "kernel" in scope "/conv_in".): pass '
     "the params from StableDiffusion.from_pretrained"),
])
def test_arguments_of_the_wrong_kind_are_named(tiny, call, error, expected):
    refused(error, lambda: call(*tiny), expected)


def test_img2img_strength_must_be_a_number(tiny):
    pipe, params = sdflax.StableDiffusionImg2Img.from_pretrained(TINY)
    ids, images = pipe.prepare_inputs(["a fox"], np.zeros((1, 32, 32, 3), np.uint8))
    refused(TypeError, lambda: pipe(ids, images, params, jax.random.key(0), "0.5"),
            "strength must be a number, got '0.5' (str)")


def test_generate_sharded_with_one_key_for_a_batch(tiny):
    pipe, params, _ = tiny
    ids = pipe.prepare_inputs(["a fox"] * jax.local_device_count())
    refused(ValueError, lambda: pipe.generate_sharded(ids, params, jax.random.key(0), 2),
            "prng_seed is one key, but generate_sharded takes one per device or per image: jax.random.split(key, ")


def test_every_number_and_picture_is_finite_in_float32(tiny):
    """NaN, inf and numbers past float32's range reached the program and drew black images (a guidance scale was
    the only number checked): one check covers every argument, a conditioning's own too."""
    import dataclasses

    pipe, params, ids = tiny
    key, latents = jax.random.PRNGKey(0), np.zeros((1, 4, 16, 16), np.float32)

    @dataclasses.dataclass(frozen=True)
    class Shift:  # a user's conditioning with one traced number
        params_name, picture, arguments = "shift", None, {"shift_scale": 0.0}

        def call_inputs(self, args, settings, batch, leading_dims):
            return jnp.asarray(args["shift_scale"], jnp.float32)

        def wrap(self, params, inputs, settings, cond, start):
            return lambda unet_fn: unet_fn

    shifted, with_shift = pipe.with_conditioning(Shift()), {**params, "shift": jnp.zeros(())}
    euler = pipe.replace()
    euler.scheduler = "euler"
    for call, name in [
        (lambda: pipe(ids, params, key, 2, latents=np.full_like(latents, np.nan)), "latents"),
        (lambda: pipe(ids, params, key, 2, latents=jnp.asarray(latents).at[0, 0, 0, 0].set(np.inf)), "latents"),
        (lambda: shifted(ids, with_shift, key, 2, shift_scale=float("nan")), "shift_scale"),
        (lambda: shifted(ids, with_shift, key, 2, shift_scale=1e39), "shift_scale"),
        (lambda: euler(ids, params, key, sigmas=[1e300, 1.0, 0.0]), "sigmas"),
    ]:
        refused(ValueError, call, f"{name} holds NaN, inf or a number past float32's range")
    # 3e38 is finite in float32, but a conditioning's scale that large overflowed its products: NaN images (issue 59's
    # hostile cases: adapter_conditioning_scale and ip_adapter_scale)
    refused(ValueError, lambda: shifted(ids, with_shift, key, 2, shift_scale=3e38), "shift_scale=3e+38 is past "
            "1e+08, where float32 arithmetic overflows into a black image: give a smaller number")


def test_settings_that_would_be_ignored_are_refused(tiny):
    """A call's guidance scale beside a guider, a misspelled scheduler_config key and a coloured IP-Adapter mask were
    ignored without a word (a PNG or a log would have recorded them)."""
    from PIL import Image

    from sdflax.guiders import ClassifierFreeGuidance

    pipe, params, ids = tiny
    guided, key = pipe.with_guider(ClassifierFreeGuidance(5.0)), jax.random.PRNGKey(0)
    refused(ValueError, lambda: guided(ids, params, key, 2, guidance_scale=3.0),
            "guidance_scale=3 with the pipeline's guider ClassifierFreeGuidance", "its guidance_scale is 5")
    refused(ValueError, lambda: guided(ids, params, key, 2, guidance_rescale=0.7), "guidance_rescale=0.7")
    for same in (5.0, 7.5):  # the guider's own scale, or the class default: nothing is lost
        guided._checked((ids, params, key, 2), {"guidance_scale": same}, guided.signature, "jit=False", 1)
    refused(ValueError, lambda: sdflax.StableDiffusion.from_pretrained(TINY, scheduler="euler", scheduler_config={
        "use_karas_sigmas": True}), "scheduler_config: EulerScheduler takes no 'use_karas_sigmas' (a misspelling?")
    red = Image.new("RGB", (64, 64), (255, 0, 0))
    refused(ValueError, lambda: pipe.prepare_ip_adapter_masks([red], 64, 64), "IP-Adapter mask 0 is coloured")
    grey = Image.new("RGB", (64, 64), (200, 200, 200))
    assert float(np.asarray(pipe.prepare_ip_adapter_masks([grey], 64, 64)).min()) == 1.0


def test_components_and_pictures_of_the_wrong_kind_are_named(tiny):
    """`adapter="path"` ended in an AttributeError at the first call; a grey (H, W) array was read as H pictures of
    one row each ("got (64,)")."""
    from sdflax.pipeline.clip_image import clip_image_inputs

    pipe, params, ids = tiny
    for name in ("adapter", "controlnet", "text_encoder", "vae"):  # text_encoder_3="none" was SD 3's alike
        refused(TypeError, lambda: sdflax.StableDiffusion(**{**pipe.components(), name: "path"}),
                f"StableDiffusion: {name}= takes a", "not str 'path'")
    refused(ValueError, lambda: clip_image_inputs(np.zeros((40, 50), np.float32)),
            "an image array must be (H, W, 3), got (40, 50)")


def test_a_pyramid_deeper_than_the_latents_is_refused(tiny):
    """FrequencyDecoupledGuidance with more levels than the latents can halve: a reshape error from inside."""
    from sdflax.guiders import FrequencyDecoupledGuidance

    pipe, params, ids = tiny
    deep = pipe.with_guider(FrequencyDecoupledGuidance(guidance_scales=(2.0,) * 8))
    with pytest.raises(ValueError, match=r"FrequencyDecoupledGuidance: 8 levels halve the latents 7 times, but these "
                                         r"are 16 wide on their short side: give at most 5 guidance_scales"):
        deep(ids, params, jax.random.PRNGKey(0), 2, height=64, width=64)


def test_a_perturbed_guider_whose_window_holds_no_step_says_so(tiny):
    """PAG's default window (0.01 to 0.2 of the steps) holds none of 4: the images equalled plain CFG's silently."""
    import warnings

    from sdflax.guiders import PerturbedAttentionGuidance

    pipe, params, ids = tiny
    layer = {"indices": [0], "fqn": "mid_block.attentions.0.transformer_blocks"}
    pag = pipe.with_guider(PerturbedAttentionGuidance(perturbed_guidance_config=layer))
    with pytest.warns(UserWarning, match=r"PerturbedAttentionGuidance: perturbed_guidance_start=0.01 and "
                                         r"perturbed_guidance_stop=0.2 hold none of the 4 steps"):
        pag._checked((ids, params, jax.random.PRNGKey(0), 4), {}, pag.signature, "jit=False", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at 10 steps step 1 is in the window: no warning
        pag._checked((ids, params, jax.random.PRNGKey(0), 10), {}, pag.signature, "jit=False", 1)


def test_the_pag_hook_beside_a_pag_guider_is_refused(tiny):
    """Each adds a perturbed batch: "array split does not result in an equal division" while tracing."""
    from sdflax import guiders
    from sdflax.hooks.pag import perturbed_attention_guidance

    pipe, params, ids = tiny
    guider = guiders.PerturbedAttentionGuidance(perturbed_guidance_config=guiders.LayerSkipConfig(
        [0], fqn="mid_block.attentions.0.transformer_blocks", skip_attention=False, skip_attention_scores=True))
    both = pipe.with_guider(guider).with_hooks(perturbed_attention_guidance(3.0))
    refused(ValueError, lambda: both(ids, params, jax.random.PRNGKey(0), 2), "the guider PerturbedAttentionGuidance "
            "and the hook PerturbedAttentionGuidance both combine the UNet's predictions: give one "
            "(PerturbedAttentionGuidance is a guider too)")


@pytest.mark.parametrize("load", [lambda dtype: sdflax.StableDiffusion.from_pretrained(TINY, dtype=dtype),
                                  lambda dtype: sdflax.UNet2DConditionModel.from_pretrained(TINY, subfolder="unet",
                                                                                            dtype=dtype)])
def test_an_integer_dtype_is_refused_before_loading(load):
    """T2IAdapter.from_pretrained(dtype=np.int32) rounded the weights to whole numbers and gave the image without
    the adapter (issue 59, cause 11): every loader takes floating dtypes only."""
    refused(TypeError, lambda: load(np.int32), "dtype must be a floating dtype (jnp.float32, jnp.bfloat16 or "
            "jnp.float16), got <class 'numpy.int32'>")
