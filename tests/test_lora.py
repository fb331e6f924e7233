"""LoRA files in the kohya/A1111 and diffusers/PEFT layouts, merged into sdflax params, against PyTorch.

The LoRA files are written here from the PyTorch module names, as the training tools do; the reference merges
the same tensors into the PyTorch modules with W += scale * alpha / rank * up @ down (and, when peft is
installed, diffusers' own load_lora_weights + fuse_lora is checked to agree with that reference).
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from builders import torch_pipeline
from safetensors.torch import save_file

import jax
import jax.numpy as jnp
from flax import traverse_util

from sdflax import StableDiffusion
from sdflax.loading.lora import LoraMismatchError, load_lora, merge_lora, read_lora
from sdflax.loading.weights import convert_state_dict

PARAM_ATOL = 1e-6  # merged float32 weights; differences are summation order in a rank-2..4 product
IMAGE_ATOL = 1e-3  # images in [0, 1], as in test_pipeline.py


@pytest.fixture(scope="module", params=["sd1", "sd2"])
def setup(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    theirs = torch_pipeline(request.param)
    theirs.save_pretrained(folder)
    pipe, params = StableDiffusion.from_pretrained(folder)
    return theirs, pipe, params


def lora_layers(model, seed, uniform=False):
    """{torch module name: (down, up, alpha)} for every Linear and Conv2d, with mixed ranks and alphas
    (or rank 4, alpha 3 everywhere: diffusers' kohya converter loses per-module alphas of attention layers)."""
    g = torch.Generator().manual_seed(seed)
    layers = {}
    for i, (name, module) in enumerate(model.named_modules()):
        if isinstance(module, torch.nn.Linear):
            down_shape, up_tail = (module.in_features,), ()
        elif isinstance(module, torch.nn.Conv2d):
            down_shape, up_tail = (module.in_channels, *module.kernel_size), (1, 1)
        else:
            continue
        rank = 4 if uniform else 2 + i % 3
        out = module.weight.shape[0]
        down = 0.3 * torch.randn((rank, *down_shape), generator=g)
        up = 0.3 * torch.randn((out, rank, *up_tail), generator=g)
        layers[name] = (down, up, 3.0 if uniform else float(1 + i % 4))
    return layers


def merged_torch(model, layers, scale, alpha_default=False):
    """A copy of `model` with the LoRA merged by the formula."""
    model = copy.deepcopy(model)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, (down, up, alpha) in layers.items():
            rank = down.shape[0]
            alpha = rank if alpha_default else alpha
            weight = modules[name].weight
            delta = up.reshape(up.shape[0], rank) @ down.reshape(rank, -1)
            weight += scale * alpha / rank * delta.reshape(weight.shape)
    return model


def both(theirs):
    """The models a LoRA trains: the UNet and the text encoder(s) of a diffusers pipeline."""
    models = {"unet": theirs.unet, "text_encoder": theirs.text_encoder}
    if getattr(theirs, "text_encoder_2", None) is not None:  # SDXL
        models["text_encoder_2"] = theirs.text_encoder_2
    return models


KOHYA_PREFIXES = {"unet": "lora_unet_", "text_encoder": "lora_te_", "text_encoder_2": "lora_te2_"}


def kohya_stem(component, name):
    """kohya's name of a module: its PyTorch path with "." -> "_" behind the component's prefix."""
    return KOHYA_PREFIXES[component] + name.replace(".", "_")


def kohya_file(path, theirs, seed=0, uniform=False, stem=kohya_stem, keep=lambda component, name: True):
    """A kohya LoRA file of every Linear/Conv2d (those `keep` accepts); `stem(component, name)` names a module."""
    tensors, layers = {}, {}
    for component, model in both(theirs).items():
        layers[component] = {name: layer for name, layer in lora_layers(model, seed, uniform).items()
                             if keep(component, name)}
        for name, (down, up, alpha) in layers[component].items():
            stem_name = stem(component, name)
            tensors[f"{stem_name}.lora_down.weight"] = down.half()  # kohya saves float16
            tensors[f"{stem_name}.lora_up.weight"] = up.half()
            tensors[f"{stem_name}.alpha"] = torch.tensor(alpha).half()
            layers[component][name] = (down.half().float(), up.half().float(), alpha)
    if str(path).endswith(".safetensors"):
        save_file(tensors, path)
    else:
        torch.save(tensors, path)
    return layers


def peft_file(path, theirs, seed=0, with_metadata=True, uniform=False):
    """diffusers' save_lora_weights layout: lora_A/lora_B, the LoraConfig (alphas) in the metadata, or none."""
    tensors, layers, metadata = {}, {}, {}
    for component, model in both(theirs).items():
        layers[component] = lora_layers(model, seed + 1, uniform)
        down, _, first_alpha = next(iter(layers[component].values()))
        ranks = {n: d.shape[0] for n, (d, _, _) in layers[component].items()}
        config = {"r": down.shape[0], "lora_alpha": first_alpha, "target_modules": sorted(layers[component]),
                  "rank_pattern": {n: r for n, r in ranks.items() if r != down.shape[0]},
                  "alpha_pattern": {n: a for n, (_, _, a) in layers[component].items() if a != first_alpha}}
        metadata.update({f"{component}.{k}": v for k, v in config.items()})
        for name, (down, up, alpha) in layers[component].items():
            tensors[f"{component}.{name}.lora_A.weight"] = down.contiguous()
            tensors[f"{component}.{name}.lora_B.weight"] = up.contiguous()
    meta = {"format": "pt", "lora_adapter_metadata": json.dumps(metadata)} if with_metadata else {"format": "pt"}
    save_file(tensors, path, metadata=meta)
    return layers


OLD_UNET = {"to_q": "to_q_lora", "to_k": "to_k_lora", "to_v": "to_v_lora", "to_out.0": "to_out_lora"}
OLD_TE = {"q_proj": "to_q_lora", "k_proj": "to_k_lora", "v_proj": "to_v_lora", "out_proj": "to_out_lora"}


def old_diffusers_file(path, theirs, seed=0):
    """Pre-PEFT diffusers: attention processors (`attn1.processor.to_q_lora.down.weight`), LoRACompatible layers
    (`proj_in.lora.down.weight`) and the text encoder's `self_attn.to_q_lora` / `mlp.fc1.lora_linear_layer`.
    These files store no alphas (alpha = rank)."""
    tensors, layers = {}, {}
    for component, renames in (("unet", OLD_UNET), ("text_encoder", OLD_TE)):
        layers[component] = lora_layers(both(theirs)[component], seed + 2)
        for name, (down, up, alpha) in layers[component].items():
            parent, _, leaf = name.rpartition(".")
            if name.endswith("to_out.0"):
                parent, leaf = name[: -len(".to_out.0")], "to_out.0"
            if leaf in renames and parent:
                middle = ".processor" if component == "unet" else ""
                stem = f"{component}.{parent}{middle}.{renames[leaf]}"
            elif component == "text_encoder":
                stem = f"{component}.{name}.lora_linear_layer"
            else:
                stem = f"{component}.{name}.lora"
            tensors[f"{stem}.down.weight"] = down.contiguous()
            tensors[f"{stem}.up.weight"] = up.contiguous()
    save_file(tensors, path)
    return layers


def expected_params(pipe, params, theirs, layers, scale, alpha_default=False):
    out = dict(params)
    for component, model in both(theirs).items():
        merged = merged_torch(model, layers[component], scale, alpha_default)
        module = getattr(pipe, component)
        state = {k: v.numpy() for k, v in merged.state_dict().items()}
        out[component] = convert_state_dict(state, module.param_shapes())
    return out


def assert_params_close(ours, expected, atol=PARAM_ATOL):
    flat_ours = traverse_util.flatten_dict(ours)
    flat_expected = traverse_util.flatten_dict(expected)
    assert flat_ours.keys() == flat_expected.keys()
    for path, value in flat_expected.items():
        np.testing.assert_allclose(flat_ours[path], value, rtol=0, atol=atol, err_msg="/".join(path))


@pytest.mark.parametrize("fmt", ["kohya.safetensors", "kohya.pt", "peft", "peft-no-alpha", "old-diffusers"])
def test_merge_equals_pytorch_formula(setup, tmp_path, fmt):
    theirs, pipe, params = setup
    path = tmp_path / ("lora." + fmt.split(".")[-1] if fmt.startswith("kohya") else "lora.safetensors")
    if fmt.startswith("kohya"):
        layers = kohya_file(path, theirs)
    elif fmt.startswith("peft"):
        layers = peft_file(path, theirs, with_metadata=fmt == "peft")
    else:
        layers = old_diffusers_file(path, theirs)
    scale = 0.8
    ours = pipe.load_lora(params, path, scale=scale)
    expected = expected_params(pipe, params, theirs, layers, scale, alpha_default=fmt in ("peft-no-alpha", "old-diffusers"))
    assert_params_close(ours, expected)
    # Every Linear/Conv of the UNet and the text encoder changed, nothing else did (the VAE is untouched).
    changed = {c: sum(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ours[c]), jax.tree.leaves(params[c])))
               for c in ("unet", "text_encoder", "vae")}
    assert changed["vae"] == 0
    assert changed["unet"] == len(layers["unet"]) and changed["text_encoder"] == len(layers["text_encoder"])


def test_two_loras_stack_and_scale_zero_is_identity(setup, tmp_path):
    theirs, pipe, params = setup
    first = kohya_file(tmp_path / "a.safetensors", theirs, seed=1)
    second = peft_file(tmp_path / "b.safetensors", theirs, seed=5)
    ours = pipe.load_lora(pipe.load_lora(params, tmp_path / "a.safetensors", 0.7), tmp_path / "b.safetensors", -0.4)
    expected = {"vae": params["vae"]}
    for component, model in both(theirs).items():
        merged = merged_torch(merged_torch(model, first[component], 0.7), second[component], -0.4)
        state = {k: v.numpy() for k, v in merged.state_dict().items()}
        expected[component] = convert_state_dict(state, getattr(pipe, component).param_shapes())
    assert_params_close(ours, expected)

    unchanged = pipe.load_lora(params, tmp_path / "a.safetensors", scale=0.0)
    for a, b in zip(jax.tree.leaves(unchanged), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


def test_traced_scale_does_not_recompile(setup, tmp_path):
    theirs, pipe, params = setup
    kohya_file(tmp_path / "a.safetensors", theirs)
    lora = read_lora(tmp_path / "a.safetensors", params)
    lora = {c: dict(list(targets.items())[:6]) for c, targets in lora.items()}  # a few layers: compiles faster
    merge = jax.jit(lambda p, lora, scale: merge_lora(p, lora, scale))  # its own cache, not merge_lora's
    for scale in (0.25, 1.5, -1.0):
        ours = merge(params, lora, jnp.float32(scale))
        assert_params_close(ours, merge_lora(params, lora, scale), atol=1e-6)
    assert merge._cache_size() == 1


def test_bfloat16_params_stay_bfloat16(setup, tmp_path):
    theirs, pipe, params = setup
    kohya_file(tmp_path / "a.safetensors", theirs)
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    ours = load_lora(half, tmp_path / "a.safetensors", 1.0)
    assert {x.dtype for x in jax.tree.leaves(ours)} == {jnp.dtype(jnp.bfloat16)}
    reference = load_lora(params, tmp_path / "a.safetensors", 1.0)
    for a, b in zip(jax.tree.leaves(ours["unet"]), jax.tree.leaves(reference["unet"])):
        np.testing.assert_allclose(np.asarray(a, np.float32), b, rtol=1e-2, atol=1e-2)  # bfloat16 has 8 bits


def test_unknown_targets_and_bad_shapes_are_listed(setup, tmp_path):
    theirs, pipe, params = setup
    good = "lora_unet_down_blocks_0_attentions_0_proj_in"
    down_in = params["unet"]["down_blocks_0_attentions_0"]["proj_in"]["kernel"].shape[-2]
    tensors = {
        f"{good}.lora_down.weight": torch.zeros(2, down_in), f"{good}.lora_up.weight": torch.zeros(down_in, 2),
        "lora_unet_down_blocks_0_attentions_0_no_such_layer.lora_down.weight": torch.zeros(2, 4),
        "lora_unet_down_blocks_0_attentions_0_no_such_layer.lora_up.weight": torch.zeros(4, 2),
        "lora_te_text_model_encoder_layers_99_mlp_fc1.lora_down.weight": torch.zeros(2, 4),
        "lora_te_text_model_encoder_layers_99_mlp_fc1.lora_up.weight": torch.zeros(4, 2),
        "lora_unet_mid_block_resnets_0_conv1.hada_w1_a": torch.zeros(2, 2),
    }
    save_file(tensors, tmp_path / "bad.safetensors")
    with pytest.raises(LoraMismatchError) as error:
        pipe.load_lora(params, tmp_path / "bad.safetensors")
    message = str(error.value)
    for name in ("lora_unet_down_blocks_0_attentions_0_no_such_layer.lora_down.weight",
                 "lora_te_text_model_encoder_layers_99_mlp_fc1.lora_down.weight",
                 "lora_unet_mid_block_resnets_0_conv1.hada_w1_a"):
        assert name in message
    assert good not in message

    save_file({f"{good}.lora_down.weight": torch.zeros(2, down_in + 1),
               f"{good}.lora_up.weight": torch.zeros(down_in, 2)}, tmp_path / "shape.safetensors")
    with pytest.raises(LoraMismatchError, match="shape mismatch.*proj_in"):
        pipe.load_lora(params, tmp_path / "shape.safetensors")


def test_images_match_diffusers_with_lora_fused(setup, tmp_path):
    theirs, pipe, params = setup
    layers = kohya_file(tmp_path / "a.safetensors", theirs)
    scale = 0.6
    fused = copy.copy(theirs)
    fused.unet = merged_torch(theirs.unet, layers["unet"], scale)
    fused.text_encoder = merged_torch(theirs.text_encoder, layers["text_encoder"], scale)
    prompts = ["a photo of an astronaut riding a horse on mars"]
    size = pipe.unet.config.sample_size
    latents = np.random.default_rng(0).standard_normal((1, 4, size, size), dtype=np.float32)
    with torch.no_grad():
        expected = fused(prompts, num_inference_steps=3, latents=torch.from_numpy(latents), output_type="np").images
        plain = theirs(prompts, num_inference_steps=3, latents=torch.from_numpy(latents), output_type="np").images
    ours = pipe(pipe.prepare_inputs(prompts), pipe.load_lora(params, tmp_path / "a.safetensors", scale),
                jax.random.key(0), 3, latents=latents).images
    np.testing.assert_allclose(ours, expected, rtol=0, atol=IMAGE_ATOL)
    assert np.abs(expected - plain).max() > 0.05  # the LoRA changes the picture, so the match means something


@pytest.mark.parametrize("fmt", ["kohya", "peft"])
def test_reference_merge_equals_diffusers_fuse_lora(setup, tmp_path, fmt):
    """diffusers' own loader (peft, in the test extra) agrees with the formula the other tests use as reference."""
    theirs, pipe, params = setup
    path = tmp_path / "lora.safetensors"
    layers = kohya_file(path, theirs, uniform=True) if fmt == "kohya" else peft_file(path, theirs)
    scale = 0.8
    fused = copy.deepcopy(theirs)
    fused.load_lora_weights(str(tmp_path), weight_name="lora.safetensors")
    fused.fuse_lora(lora_scale=scale)
    fused.unload_lora_weights()
    for component, model in both(theirs).items():
        reference = merged_torch(model, layers[component], scale).state_dict()
        for key, value in getattr(fused, component).state_dict().items():
            np.testing.assert_allclose(value.numpy(), reference[key].numpy(), rtol=0, atol=PARAM_ATOL, err_msg=key)
