"""Flux.1 LoRA files in the diffusers/PEFT, kohya/ComfyUI, XLabs and Black Forest Labs layouts, merged by sdflax's
`load_lora`, against diffusers' FluxPipeline.load_lora_weights + fuse_lora on the small random dev-shaped pipeline
of test_flux_pipeline.py: the merged transformer and CLIP weights, one image, two LoRAs at two scales, a traced
scale, and the one-line errors (another family's LoRA, names that place nowhere, a Flux Control LoRA).

The LoRAs are written here from the PyTorch models' layers (BFL's fused qkv and linear1 as one LoRA each, as kohya,
XLabs and BFL train them). diffusers' kohya and BFL converters hard-code FLUX.1's sizes (19 double and 38 single
blocks, 3072 wide): the references run the same code with the small model's sizes put in (`small_converters`).
"""

from __future__ import annotations

import copy
import inspect
import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util
from builders import REPO
from safetensors.torch import save_file
from test_flux_pipeline import (PROMPTS, T5_LENGTH, TRANSFORMER, check_images, latents_for, ours_images,
                                theirs_images, torch_flux_pipeline)

from sdflax import Flux, StableDiffusion
from sdflax.loading.flux_names import SWAPPED, flux_table
from sdflax.loading.flux_lora import read_flux_lora
from sdflax.loading.lora import LoraMismatchError, merge_lora
from sdflax.loading.weights import convert_state_dict

RTOL = 1e-5  # merged float32 weights, of each tensor's largest magnitude
MOVES = 1e-2  # what each LoRA changes in diffusers' transformer output, at least
WIDTH = TRANSFORMER["num_attention_heads"] * TRANSFORMER["attention_head_dim"]
# Every layout but PEFT's (whose config names each layer's rank and alpha) is written with one rank, as trainers
# write them: diffusers loads those files with the first layer's rank as every layer's PEFT alpha, so that a layer of
# another rank gets another scale than kohya's alpha / rank (sdflax's)
RANK = 4
# alpha / rank a power of two: diffusers multiplies kohya's float16 weights by it in float16, exactly only then
ALPHAS = (0.5, 1.0, 2.0, 8.0)


@pytest.fixture(scope="module")
def small_converters():
    """diffusers' kohya and BFL converters with the small model's block counts and widths in place of FLUX.1's."""
    import diffusers.loaders.lora_conversion_utils as utils
    import diffusers.loaders.lora_pipeline as loaders

    sizes = {"_convert_kohya_flux_lora_to_diffusers": {
                 "dims=[3072, 3072, 3072, 12288]": f"dims=[{WIDTH}, {WIDTH}, {WIDTH}, {4 * WIDTH}]"},
             "_convert_bfl_flux_control_lora_to_diffusers": {
                 "num_layers = 19": f"num_layers = {TRANSFORMER['num_layers']}",
                 "num_single_layers = 38": f"num_single_layers = {TRANSFORMER['num_single_layers']}",
                 "inner_dim = 3072": f"inner_dim = {WIDTH}"}}
    with pytest.MonkeyPatch.context() as patch:
        for name, replacements in sizes.items():
            source = textwrap.dedent(inspect.getsource(getattr(utils, name)))
            for old, new in replacements.items():
                assert source.count(old) == 1, (name, old)
                source = source.replace(old, new)
            namespace = dict(vars(utils))
            exec(compile(source, utils.__file__, "exec"), namespace)
            patch.setattr(loaders, name, namespace[name])
        yield


@pytest.fixture(scope="module")
def flux(tmp_path_factory, small_converters):
    tmp = tmp_path_factory.mktemp("flux_lora")
    theirs = torch_flux_pipeline(tmp)
    theirs.save_pretrained(tmp / "dev", safe_serialization=True)
    return (theirs, *Flux.from_pretrained(tmp / "dev"))


# ---- LoRA files ---------------------------------------------------------------------------------------------------
def linears(model) -> dict:
    return {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def random_lora(g, inp, out, rank):
    return 0.3 * torch.randn((rank, inp), generator=g), 0.3 * torch.randn((out, rank), generator=g)


def bfl_layers(transformer, seed, keep=lambda bfl: True) -> dict:
    """{BFL module: (down, up, alpha)} for every linear layer in BFL's names (a fused one as one LoRA) that `keep`
    takes."""
    g, modules = torch.Generator().manual_seed(seed), linears(transformer)
    layers = {}
    for i, (bfl, names) in enumerate(sorted(flux_table(transformer.config).items())):
        names = names if isinstance(names, tuple) else (names,)
        if names[0] not in modules or not keep(bfl):
            continue
        inp, out = modules[names[0]].in_features, sum(modules[n].out_features for n in names)
        layers[bfl] = (*random_lora(g, inp, out, RANK), ALPHAS[i % 4])
    return layers


def torch_layers(model, seed, rank=RANK) -> dict:
    """{PyTorch module name: (down, up, alpha)} for every linear layer of `model`, of `rank` (None: 2..4)."""
    g = torch.Generator().manual_seed(seed)
    return {name: (*random_lora(g, m.in_features, m.out_features, rank or 2 + i % 3), ALPHAS[i % 4])
            for i, (name, m) in enumerate(sorted(linears(model).items()))}


def in_blocks(bfl):
    return bfl.startswith(("double_blocks.", "single_blocks."))


def kohya_file(path, theirs, seed=0, comfy=False, keep=in_blocks):
    """kohya's sd-scripts (or, `comfy`, ComfyUI's diffusion_model. / text_encoders.clip_l.transformer. names) in
    float16 with alphas: the transformer in BFL's names (the blocks: diffusers' converter loses the LoRAs of the
    layers outside them), CLIP as lora_te1_* (its layers named as transformers 5 names them, without text_model.,
    which diffusers would not find)."""
    layers = {"transformer": bfl_layers(theirs.transformer, seed, keep),
              "text_encoder": torch_layers(theirs.text_encoder, seed + 1)}
    tensors = {}
    for component, prefix in (("transformer", "diffusion_model." if comfy else "lora_unet_"),
                              ("text_encoder", "text_encoders.clip_l.transformer." if comfy else "lora_te1_")):
        for name, (down, up, alpha) in layers[component].items():
            stem = prefix + (name if comfy else name.replace(".", "_"))
            tensors.update({f"{stem}.lora_down.weight": down.half(), f"{stem}.lora_up.weight": up.half(),
                            f"{stem}.alpha": torch.tensor(alpha).half()})
    save_file(tensors, path)


def peft_file(path, theirs, seed=0, components=("transformer", "text_encoder")):
    """diffusers' save_lora_weights: lora_A / lora_B in diffusers' names, the alphas in lora_adapter_metadata."""
    tensors, metadata = {}, {}
    for component, model in ((c, getattr(theirs, c)) for c in components):
        layers = torch_layers(model, seed + len(component), rank=None)
        longest_first = sorted(layers, key=len, reverse=True)  # PEFT takes the first pattern matching a name's end
        config = {"r": 2, "lora_alpha": 1.0, "target_modules": sorted(layers),
                  "rank_pattern": {n: layers[n][0].shape[0] for n in longest_first if layers[n][0].shape[0] != 2},
                  "alpha_pattern": {n: layers[n][2] for n in longest_first if layers[n][2] != 1.0}}
        metadata.update({f"{component}.{k}": v for k, v in config.items()})
        for name, (down, up, _) in layers.items():
            tensors.update({f"{component}.{name}.lora_A.weight": down, f"{component}.{name}.lora_B.weight": up})
    save_file(tensors, path, metadata={"format": "pt", "lora_adapter_metadata": json.dumps(metadata)})


def mixture_file(path, theirs, seed=0):
    """kohya's diffusers-named flavour: lora_transformer_<diffusers name>, alphas stored; in the blocks only the
    attention's layers (diffusers' converter maps no other layer of a block), no CLIP (diffusers maps its
    lora_te1_text_model_* to text_model., which transformers 5's CLIP does not have)."""
    tensors = {}
    for name, (down, up, alpha) in torch_layers(theirs.transformer, seed).items():
        if "blocks." not in name or ".attn." in name:
            stem = "lora_transformer_" + name.replace(".", "_")
            tensors.update({f"{stem}.lora_down.weight": down, f"{stem}.lora_up.weight": up,
                            f"{stem}.alpha": torch.tensor(alpha)})
    save_file(tensors, path)


XLABS = {"img_attn.qkv": "qkv_lora1", "img_attn.proj": "proj_lora1", "txt_attn.qkv": "qkv_lora2",
         "txt_attn.proj": "proj_lora2", "linear1": "qkv_lora", "linear2": "proj_lora"}


def xlabs_file(path, theirs, seed=0):
    """XLabs' attention processors: both streams' qkv and proj, a single block's qkv (linear1's q, k, v rows) and
    linear2; no alphas."""
    tensors = {}
    for bfl, (down, up, _) in bfl_layers(theirs.transformer, seed, lambda bfl: bfl.split(".", 2)[-1] in XLABS).items():
        blocks, i, layer = bfl.split(".", 2)
        up = up[: 3 * WIDTH] if layer == "linear1" else up
        stem = f"{blocks}.{i}.processor.{XLABS[layer]}"
        tensors.update({f"{stem}.down.weight": down, f"{stem}.up.weight": up})
    save_file(tensors, path)


def bfl_file(path, theirs, seed=0):
    """BFL's Control LoRA layout (without the wider image embedder): lora_A / lora_B in BFL's names for every layer,
    the q / k RMSNorm scales it replaces, no alphas. diffusers' converter swaps the halves of the final modulation's
    lora_A as well as of its lora_B (only the latter is the (shift, scale) order): that down's two halves are the
    same here, so that the swap changes nothing."""
    g = torch.Generator().manual_seed(seed + 7)
    tensors = {}
    for bfl, (down, up, _) in bfl_layers(theirs.transformer, seed).items():
        if bfl == SWAPPED:
            down = torch.cat([down[: RANK // 2]] * 2)
        tensors.update({f"{bfl}.lora_A.weight": down, f"{bfl}.lora_B.weight": up})
    for bfl in flux_table(theirs.transformer.config):
        if bfl.endswith(("query_norm", "key_norm")):
            tensors[f"{bfl}.scale"] = 1 + 0.2 * torch.randn(theirs.transformer.config.attention_head_dim, generator=g)
    save_file(tensors, path)


WRITERS = {"peft": peft_file, "kohya": kohya_file, "comfy": lambda p, t, seed=0: kohya_file(p, t, seed, comfy=True),
           "mixture": mixture_file, "xlabs": xlabs_file, "bfl": bfl_file}


# ---- diffusers' merge ---------------------------------------------------------------------------------------------
def theirs_merged(theirs, files: dict):
    """(transformer, text_encoder) of a copy of `theirs` with diffusers' load_lora_weights of each file (path ->
    scale) and fuse_lora."""
    fused = copy.deepcopy(theirs)
    for i, path in enumerate(files):
        fused.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name=f"lora{i}")
    fused.set_adapters([f"lora{i}" for i in range(len(files))], list(files.values()))
    fused.fuse_lora(components=["transformer", "text_encoder"], adapter_names=[f"lora{i}" for i in range(len(files))])
    return fused.transformer, fused.text_encoder


def fused_params(model, shapes):
    """A PEFT-wrapped model's fused weights as sdflax params."""
    state = {k.replace(".base_layer.", "."): v.numpy() for k, v in model.state_dict().items() if ".lora_" not in k}
    return convert_state_dict(state, shapes)


def assert_params_close(ours, expected):
    flat_ours, flat_expected = traverse_util.flatten_dict(ours), traverse_util.flatten_dict(expected)
    assert flat_ours.keys() == flat_expected.keys()
    for path, value in flat_expected.items():
        np.testing.assert_allclose(flat_ours[path], value, rtol=0, atol=RTOL * np.abs(value).max(),
                                   err_msg="/".join(path))


def transformer_output(transformer):
    rng = np.random.default_rng(0)
    x = {"hidden_states": rng.standard_normal((1, 16, TRANSFORMER["in_channels"])),
         "encoder_hidden_states": rng.standard_normal((1, 5, TRANSFORMER["joint_attention_dim"])),
         "pooled_projections": rng.standard_normal((1, TRANSFORMER["pooled_projection_dim"])),
         "timestep": np.array([0.7]), "img_ids": rng.integers(0, 4, (16, 3)), "txt_ids": np.zeros((5, 3)),
         "guidance": np.array([3.5])}
    with torch.no_grad():
        return transformer(**{k: torch.from_numpy(v).float() for k, v in x.items()}).sample.numpy()


def check_against_diffusers(theirs, pipe, params, ours, files):
    transformer, text_encoder = theirs_merged(theirs, files)
    assert_params_close(ours["transformer"], fused_params(transformer, pipe.transformer.param_shapes()))
    assert_params_close(ours["text_encoder"], fused_params(text_encoder, pipe.text_encoder.param_shapes()))
    for name in ("vae", "text_encoder_2"):
        assert ours[name] is params[name]
    plain = transformer_output(theirs.transformer)
    assert np.abs(transformer_output(transformer) - plain).max() > MOVES * np.abs(plain).max()


# ---- tests --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", sorted(WRITERS))
def test_each_layout_merges_as_diffusers(flux, tmp_path, layout):
    theirs, pipe, params = flux
    path = tmp_path / f"{layout}.safetensors"
    WRITERS[layout](path, theirs)
    ours = pipe.load_lora(params, path, scale=0.7)
    check_against_diffusers(theirs, pipe, params, ours, {path: 0.7})
    changed = {c: sum(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ours[c]), jax.tree.leaves(params[c])))
               for c in ("transformer", "text_encoder")}
    assert changed["transformer"] > 0 and (changed["text_encoder"] > 0) == (layout in ("peft", "kohya", "comfy"))


def test_kohya_names_outside_the_blocks_and_t5_place_as_bfl_names(flux, tmp_path):
    """kohya's names of the embedders and the final layer (which diffusers' converter loses) reach the layers BFL's
    names reach, with the same rows; its lora_te2_* (T5, which diffusers skips) merge by the formula."""
    theirs, pipe, params = flux
    kohya_file(tmp_path / "k.safetensors", theirs, keep=lambda bfl: True)
    bfl_file(tmp_path / "b.safetensors", theirs)
    kohya, bfl = (read_flux_lora(tmp_path / f"{n}.safetensors", params)["transformer"] for n in "kb")
    assert "norm_out_linear/kernel" in kohya and "time_text_embed_guidance_embedder_linear_1/kernel" in kohya
    assert set(bfl) - set(kohya) == {name for name in bfl if name.endswith("/scale")}
    for name, w in kohya.items():
        for part in ("down", "up"):
            expected = bfl[name][part] if name != "norm_out_linear/kernel" or part == "up" else \
                np.asarray(bfl_layers(theirs.transformer, 0)[SWAPPED][0])  # (BFL's final down has equal halves)
            np.testing.assert_allclose(w[part], expected, rtol=1e-3, atol=1e-3, err_msg=name)

    g = torch.Generator().manual_seed(3)
    t5 = {name: random_lora(g, m.in_features, m.out_features, RANK) for name, m in linears(theirs.text_encoder_2).items()}
    save_file({f"lora_te2_{n.replace('.', '_')}.{role}.weight": t for n, (down, up) in t5.items()
               for role, t in (("lora_down", down), ("lora_up", up))}, tmp_path / "t5.safetensors")
    ours = pipe.load_lora(params, tmp_path / "t5.safetensors", scale=0.5)
    flat = traverse_util.flatten_dict(params["text_encoder_2"], sep="/")
    merged = traverse_util.flatten_dict(ours["text_encoder_2"], sep="/")
    for name, (down, up) in t5.items():
        path = next(p for p in flat if p.replace("/", "_") == f"{name.replace('.', '_')}_kernel")
        np.testing.assert_allclose(merged[path], flat[path] + 0.5 * (up @ down).numpy().T, rtol=0, atol=1e-6)
    assert len(t5) == sum(not np.array_equal(merged[p], flat[p]) for p in flat)


def test_two_loras_at_two_scales_match_diffusers_adapters(flux, tmp_path):
    theirs, pipe, params = flux
    kohya_file(tmp_path / "a.safetensors", theirs, seed=1)
    peft_file(tmp_path / "b.safetensors", theirs, seed=2)
    ours = pipe.load_lora(pipe.load_lora(params, tmp_path / "a.safetensors", 0.7), tmp_path / "b.safetensors", -0.4)
    check_against_diffusers(theirs, pipe, params, ours, {tmp_path / "a.safetensors": 0.7,
                                                         tmp_path / "b.safetensors": -0.4})


def test_traced_scale_does_not_recompile(flux, tmp_path):
    theirs, pipe, params = flux
    xlabs_file(tmp_path / "x.safetensors", theirs)
    lora = read_flux_lora(tmp_path / "x.safetensors", params)
    merge = jax.jit(lambda p, lora, scale: merge_lora(p, lora, scale))
    for scale in (0.25, -1.0):
        assert_params_close(merge(params, lora, jnp.float32(scale))["transformer"],
                            merge_lora(params, lora, scale)["transformer"])
    assert merge._cache_size() == 1


def test_image_matches_diffusers_with_a_kohya_lora(flux, tmp_path):
    theirs, pipe, params = flux
    kohya_file(tmp_path / "a.safetensors", theirs)
    fused = copy.deepcopy(theirs)
    fused.load_lora_weights(str(tmp_path), weight_name="a.safetensors")
    fused.fuse_lora(components=["transformer", "text_encoder"], lora_scale=0.8)
    expected, plain = theirs_images(fused, PROMPTS[:1]), theirs_images(theirs, PROMPTS[:1])
    assert np.abs(expected - plain).max() > 0.05
    ids = pipe.prepare_inputs(PROMPTS[:1], max_sequence_length=T5_LENGTH)
    merged = pipe.load_lora(params, tmp_path / "a.safetensors", scale=0.8)
    check_images(ours_images(pipe, merged, ids, latents=latents_for(1), guidance_scale=3.5), expected)


# ---- one-line errors ----------------------------------------------------------------------------------------------
def one_line_error(load, match):
    with pytest.raises(LoraMismatchError, match=match) as error:
        load()
    assert "\n" not in str(error.value)
    return str(error.value)


def test_another_familys_lora_is_one_line(flux, tmp_path):
    theirs, pipe, params = flux
    sd = "lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn2_to_k"
    save_file({f"{sd}.lora_down.weight": torch.zeros(4, 768), f"{sd}.lora_up.weight": torch.zeros(640, 4),
               "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight": torch.zeros(4, 768),
               "lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": torch.zeros(3072, 4)},
              tmp_path / "sd15.safetensors")
    one_line_error(lambda: pipe.load_lora(params, tmp_path / "sd15.safetensors"),
                   r"sd15.safetensors is a LoRA for SD 1.x, this pipeline is Flux.1 .*load it with StableDiffusion$")
    sd3 = "lora_unet_joint_blocks_0_x_block_attn_qkv"
    save_file({f"{sd3}.lora_down.weight": torch.zeros(4, 1536), f"{sd3}.lora_up.weight": torch.zeros(4608, 4)},
              tmp_path / "sd3.safetensors")
    one_line_error(lambda: pipe.load_lora(params, tmp_path / "sd3.safetensors"), "is a LoRA for SD 3.x")

    sd_pipe, sd_params = StableDiffusion.from_pretrained(REPO / "weights" / "tiny-sd")
    kohya_file(tmp_path / "flux.safetensors", theirs)
    one_line_error(lambda: sd_pipe.load_lora(sd_params, tmp_path / "flux.safetensors"),
                   r"flux.safetensors is a LoRA for Flux.1, this pipeline is SD 1.x/2.x .*load it with sdflax.Flux$")


def test_names_it_cannot_place_are_one_line(flux, tmp_path):
    theirs, pipe, params = flux
    good = "lora_unet_double_blocks_0_img_attn_proj"
    save_file({f"{good}.lora_down.weight": torch.zeros(4, WIDTH), f"{good}.lora_up.weight": torch.zeros(WIDTH, 4),
               **{f"lora_unet_double_blocks_{i}_no_such_layer.lora_{role}.weight": torch.zeros(4, 4)
                  for i in range(20) for role in ("down", "up")},
               "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight": torch.zeros(4, WIDTH),
               "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight": torch.zeros(3 * WIDTH + 1, 4),
               "lora_unet_single_blocks_0_linear1.hada_w1_a": torch.zeros(2, 2)}, tmp_path / "bad.safetensors")
    message = one_line_error(lambda: pipe.load_lora(params, tmp_path / "bad.safetensors"), "does not fit")
    assert "targets not in the model: lora_unet_double_blocks_0_no_such_layer.lora_down.weight" in message
    assert "and 28 more" in message and good not in message  # 40 named, 12 shown
    assert "img_attn_qkv.lora_up.weight: up (97, 4) does not split into 3 layers of 32 + 32 + 32 rows" in message
    assert "hada_w1_a" in message


def test_a_flux_control_lora_is_one_line(flux, tmp_path):
    """BFL's Control LoRAs widen the image embedder (latents and control latents) and carry LoRA biases."""
    theirs, pipe, params = flux
    save_file({"img_in.lora_A.weight": torch.zeros(4, 128), "img_in.lora_B.weight": torch.zeros(WIDTH, 4),
               "img_in.lora_B.bias": torch.zeros(WIDTH)}, tmp_path / "canny.safetensors")
    one_line_error(lambda: pipe.load_lora(params, tmp_path / "canny.safetensors"),
                   "canny.safetensors is a Flux Control LoRA .* 128 features .* takes 64")
