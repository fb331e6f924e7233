"""FluxTransformer2DModel (FLUX.1's transformer) against diffusers' PyTorch model, saved with save_pretrained (one
file, or shards) and loaded by sdflax: with a guidance embedder (FLUX.1-dev's shape) and without (schnell's), small
and random; and Black Forest Labs' single files, written here from the same weights, loading to the same params."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_single_file import assert_same_params

from sdflax.hooks.core import Hook, intercept
from sdflax.loading import single_file
from sdflax.loading.flux_single_file import FluxFiles, load_flux_single_file
from sdflax.models import FluxTransformer2DModel, FluxTransformerConfig
from sdflax.models.config import ConfigError

RTOL, ATOL = 1e-4, 1e-5  # float32 parity
MOVES = 1e-2  # what another guidance scale changes in diffusers' output at least, of its largest magnitude

BASE = dict(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24, axes_dims_rope=(4, 6, 6))
VARIANTS = {"dev": dict(BASE, guidance_embeds=True), "schnell": dict(BASE, guidance_embeds=False),
            "dev_sharded": dict(BASE, guidance_embeds=True, out_channels=8)}
GRID, TEXT = (3, 4), 5  # image tokens (rows, columns), text tokens
GUIDANCE = np.array([3.5, 5.0], np.float32)


def torch_transformer(config, seed=0):
    """diffusers' model with its random init and random RMSNorm scales (ones at init)."""
    from diffusers import FluxTransformer2DModel as Theirs

    torch.manual_seed(seed)
    model = Theirs(**config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"\.norm_(added_)?[qk]\.weight$", name):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
    return model


def inputs(config, seed=0):
    """(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids, guidance): every
    axis of the ids in use, the text's too (FLUX.1's are zeros), so each token's rotation is tested."""
    rng = np.random.default_rng(seed)
    rows, columns = GRID
    img_ids = np.stack([rng.integers(0, 2, rows * columns), np.repeat(np.arange(rows), columns),
                        np.tile(np.arange(columns), rows)], axis=-1).astype(np.float32)
    return (rng.standard_normal((2, rows * columns, config["in_channels"]), dtype=np.float32),
            rng.standard_normal((2, TEXT, config["joint_attention_dim"]), dtype=np.float32),
            rng.standard_normal((2, config["pooled_projection_dim"]), dtype=np.float32),
            np.array([0.9, 0.3], np.float32), img_ids, rng.integers(0, 3, (TEXT, 3)).astype(np.float32),
            GUIDANCE if config["guidance_embeds"] else None)


def theirs_output(model, x):
    with torch.no_grad():
        return model(*(None if a is None else torch.from_numpy(a) for a in x)).sample.numpy()


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def loaded(request, tmp_path_factory):
    config = VARIANTS[request.param]
    theirs = torch_transformer(config)
    folder = tmp_path_factory.mktemp(request.param) / "transformer"
    if request.param.endswith("sharded"):
        theirs.save_pretrained(folder, max_shard_size="20KB")
        assert (folder / "diffusion_pytorch_model.safetensors.index.json").is_file()
    else:
        theirs.save_pretrained(folder)
    model, params = FluxTransformer2DModel.from_pretrained(folder)
    return config, theirs, model, params


def test_matches_diffusers(loaded):
    config, theirs, model, params = loaded
    x = inputs(config)
    ours = jax.jit(model.apply)(params, *x)
    assert ours.shape == (2, GRID[0] * GRID[1], config.get("out_channels", config["in_channels"]))
    np.testing.assert_allclose(np.asarray(ours), theirs_output(theirs, x), rtol=RTOL, atol=ATOL)


def test_guidance_scale_as_diffusers(loaded):
    config, theirs, model, params = loaded
    if not config["guidance_embeds"]:
        pytest.skip("schnell's shape embeds no guidance")
    x = inputs(config, seed=1)
    other = (*x[:-1], np.array([1.0, 9.0], np.float32))
    expected = theirs_output(theirs, other)
    assert np.abs(expected - theirs_output(theirs, x)).max() > MOVES * np.abs(expected).max()
    ours = jax.jit(model.apply)(params, *other)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=RTOL, atol=ATOL)


def test_ids_with_a_batch_axis_are_its_first_entry(loaded):
    """diffusers' deprecated (B, L, 3) ids: it reads ids[0]."""
    config, theirs, model, params = loaded
    x = list(inputs(config, seed=2))
    plain = np.asarray(jax.jit(model.apply)(params, *x))
    x[4], x[5] = np.stack([x[4], x[4] + 7]), np.stack([x[5], x[5] - 1])
    np.testing.assert_allclose(np.asarray(jax.jit(model.apply)(params, *x)), plain, rtol=RTOL, atol=ATOL)


def test_attention_layers_are_hook_sites_over_image_then_text():
    """Every attention is a JointAttention site whose joint sequence starts with the image's tokens, as SD 3's: the
    hooks read `image_tokens` and the image tokens' queries there."""

    class Recorder(Hook):
        def __init__(self):
            self.attended, self.queried = {}, {}

        def attend(self, site, attend, q, k, v):
            self.attended[site.name] = (site.joint_attention, site.image_tokens, q.shape[1], k.shape[1])
            return attend(q, k, v)

        def queries(self, site, q):
            self.queried[site.name] = q.shape[1]
            return q

    config = VARIANTS["dev"]
    model = FluxTransformer2DModel.from_config(config)
    params = jax.eval_shape(model.init_params, jax.random.key(0))
    recorder, sites = Recorder(), set()
    with intercept([recorder], step=0, chunks=1, sites=sites):
        jax.eval_shape(model.apply, params, *inputs(config))
    names = {"transformer_blocks.0.attn", "transformer_blocks.1.attn", "single_transformer_blocks.0.attn",
             "single_transformer_blocks.1.attn"}
    n = GRID[0] * GRID[1]
    assert sites == names
    assert recorder.attended == dict.fromkeys(names, (True, n, n + TEXT, n + TEXT))
    assert recorder.queried == dict.fromkeys(names, n)


def test_bfloat16_keeps_its_dtype_and_follows_float32(loaded):
    config, _, model, params = loaded
    if config != VARIANTS["dev"]:
        pytest.skip("one variant is enough")
    half = FluxTransformer2DModel(model.config, jnp.bfloat16, kernels=model.kernels)
    x = inputs(config)
    out = jax.jit(half.apply)(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), *x)
    assert out.dtype == jnp.bfloat16
    full = np.asarray(jax.jit(model.apply)(params, *x))
    assert np.abs(np.asarray(out, np.float32) - full).max() < 0.05 * np.abs(full).max()


def test_bad_configs_fail_in_one_line():
    cases = [(dict(patch_size=2), "patch_size"), (dict(axes_dims_rope=[4, 6, 4]), "axes_dims_rope"),
             (dict(axes_dims_rope=[8, 8]), "axes_dims_rope"), (dict(axes_dims_rope=[5, 5, 6]), "axes_dims_rope"),
             (dict(guidance_embeds="yes"), "guidance_embeds")]
    for change, key in cases:
        with pytest.raises(ConfigError, match=key) as e:
            FluxTransformerConfig.from_dict({**BASE, **change})
        assert "\n" not in str(e.value)
    assert FluxTransformerConfig.from_dict({**BASE, "out_channels": None}).out_channels == 16
    assert FluxTransformerConfig().out_channels == 64  # FLUX.1's


def test_bad_inputs_fail_in_one_line():
    for name, config in (("dev", VARIANTS["dev"]), ("schnell", VARIANTS["schnell"])):
        model = FluxTransformer2DModel.from_config(config)
        params = jax.eval_shape(model.init_params, jax.random.key(0))
        x = list(inputs(config))
        wrong_guidance = list(x)
        wrong_guidance[-1] = None if name == "dev" else GUIDANCE
        short_ids = list(x)
        short_ids[4] = x[4][:-1]
        for bad, message in ((wrong_guidance, "guidance"), (short_ids, "img_ids")):
            with pytest.raises(ValueError, match=message) as e:
                jax.eval_shape(model.apply, params, *bad)
            assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------------------
# diffusers names -> Black Forest Labs', written independently of sdflax/loading/flux_names.py's table


def to_bfl(state, config, prefix=""):
    """The transformer's state dict in BFL's names (the reverse of diffusers'
    `convert_flux_transformer_checkpoint_to_diffusers`); every tensor is used exactly once."""
    used, out = set(), {}

    def take(key):
        used.add(key)
        return state[key]

    def put(theirs, ours, leaves=("weight", "bias")):
        for leaf in leaves:
            out[f"{prefix}{theirs}.{leaf}"] = take(f"{ours}.{leaf}")

    embedders = {"time_in": "timestep_embedder", "vector_in": "text_embedder", "guidance_in": "guidance_embedder"}
    for theirs, ours in embedders.items():
        if f"time_text_embed.{ours}.linear_1.weight" in state:
            put(f"{theirs}.in_layer", f"time_text_embed.{ours}.linear_1")
            put(f"{theirs}.out_layer", f"time_text_embed.{ours}.linear_2")
    put("img_in", "x_embedder")
    put("txt_in", "context_embedder")
    put("final_layer.linear", "proj_out")
    for leaf in ("weight", "bias"):  # (scale, shift) in diffusers, (shift, scale) in BFL's
        scale, shift = take(f"norm_out.linear.{leaf}").chunk(2)
        out[f"{prefix}final_layer.adaLN_modulation.1.{leaf}"] = torch.cat([shift, scale])
    for i in range(config["num_layers"]):
        b, d = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for leaf in ("weight", "bias"):
            out[f"{prefix}{d}img_attn.qkv.{leaf}"] = torch.cat([take(f"{b}attn.to_{n}.{leaf}") for n in "qkv"])
            out[f"{prefix}{d}txt_attn.qkv.{leaf}"] = torch.cat([take(f"{b}attn.add_{n}_proj.{leaf}") for n in "qkv"])
        pairs = {"img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
                 "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out", "img_mlp.0": "ff.net.0.proj",
                 "img_mlp.2": "ff.net.2", "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2"}
        for theirs, ours in pairs.items():
            put(d + theirs, b + ours)
        for stream, added in (("img", ""), ("txt", "added_")):
            for kind in ("query", "key"):
                out[f"{prefix}{d}{stream}_attn.norm.{kind}_norm.scale"] = take(f"{b}attn.norm_{added}{kind[0]}.weight")
    for i in range(config["num_single_layers"]):
        b, s = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for leaf in ("weight", "bias"):
            out[f"{prefix}{s}linear1.{leaf}"] = torch.cat([take(f"{b}attn.to_{n}.{leaf}") for n in "qkv"]
                                                          + [take(f"{b}proj_mlp.{leaf}")])
        put(s + "linear2", b + "proj_out")
        put(s + "modulation.lin", b + "norm.linear")
        for kind in ("query", "key"):
            out[f"{prefix}{s}norm.{kind}_norm.scale"] = take(f"{b}attn.norm_{kind[0]}.weight")
    assert used == set(state), sorted(set(state) - used)[:5]
    return {k: v.contiguous() for k, v in out.items()}


@pytest.fixture(scope="module")
def bfl_state(loaded):
    config, theirs, _, _ = loaded
    return to_bfl(theirs.state_dict(), config)


@pytest.mark.parametrize("prefix", ["", "model.diffusion_model."])
def test_single_file_gives_the_folders_params(loaded, bfl_state, tmp_path, prefix):
    config, _, model, params = loaded
    path = tmp_path / "flux1.safetensors"
    save_file({prefix + k: v for k, v in bfl_state.items()}, path)
    ours, file_params = load_flux_single_file(path, config={"axes_dims_rope": config["axes_dims_rope"]})
    assert ours.config == model.config
    assert_same_params(file_params, params)
    if config == VARIANTS["dev"] and not prefix:  # bfloat16: cast tensor by tensor, as the folder's
        _, half = load_flux_single_file(path, config={"axes_dims_rope": (4, 6, 6)}, dtype=jnp.bfloat16)
        assert_same_params(half, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))


def test_single_file_pipeline_names(bfl_state):
    shapes = {k: np.empty(v.shape, np.float32) for k, v in bfl_state.items()}
    prefixed = {"model.diffusion_model." + k: v for k, v in shapes.items()}
    assert FluxFiles.pipeline_name(shapes) == FluxFiles.pipeline_name(prefixed) == "FluxPipeline"
    inner = shapes["img_in.weight"].shape[0]
    assert FluxFiles.pipeline_name({**shapes, "img_in.weight": np.empty((inner, 384))}) == "FluxFillPipeline"
    assert FluxFiles.pipeline_name({**shapes, "img_in.weight": np.empty((inner, 128))}) == "FluxControlPipeline"
    sd3 = {"model.diffusion_model.joint_blocks.0.x_block.attn.qkv.weight": np.empty((6, 2))}
    assert FluxFiles.pipeline_name(sd3) is None
    assert FluxFiles.pipeline_name({**shapes, "single_stream_modulation.lin.weight": np.empty(1)}) is None  # FLUX.2
    assert single_file.UNetFiles.pipeline_name(prefixed) is None
    assert single_file.MMDiTFiles.pipeline_name(prefixed) is None
    with pytest.raises(single_file.SingleFileError, match="FLUX.1"):
        single_file.detect_version(prefixed)


def test_bad_single_files_fail_in_one_line(loaded, bfl_state, tmp_path):
    config = loaded[0]
    rows = bfl_state["single_blocks.0.linear1.weight"].shape[0]
    cases = {
        "missing": ({k: v for k, v in bfl_state.items() if k != "double_blocks.1.txt_mlp.2.bias"},
                    "transformer_blocks_1/ff_context_net_2/bias"),
        "linear1": ({**bfl_state, "single_blocks.0.linear1.weight": bfl_state["single_blocks.0.linear1.weight"][:-2]},
                    "single_blocks.0.linear1.weight"),
        "qkv": ({**bfl_state, "double_blocks.0.img_attn.qkv.bias": bfl_state["double_blocks.0.img_attn.qkv.bias"][:-1]},
                "double_blocks.0.img_attn.qkv.bias"),
        "unknown": ({**bfl_state, "double_blocks.0.img_attn.extra.weight": torch.zeros(2)},
                    "double_blocks.0.img_attn.extra.weight"),
        "no img_in": ({k: v for k, v in bfl_state.items() if not k.startswith("img_in.")}, "img_in.weight"),
        "not flux": ({"joint_blocks.0.x_block.attn.qkv.weight": torch.zeros(6, 2)}, "not a FLUX.1 transformer"),
    }
    assert rows % 7 == 0
    for name, (state, message) in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.safetensors"
        save_file({k: v.contiguous() for k, v in state.items()}, path)
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            load_flux_single_file(path, config={"axes_dims_rope": config["axes_dims_rope"]})
        assert "\n" not in str(e.value), name


def test_layout_reads_a_file_with_a_folders_configs(loaded, bfl_state, tmp_path):
    """`read_single_file(FluxFiles, ...)`, as a FLUX.1 pipeline reads a file: the transformer from the file, its
    config from the folder's (FLUX.1-dev's defaults here) changed to the file's shapes, the scheduler the folder's."""
    import json

    from diffusers import FlowMatchEulerDiscreteScheduler

    config, _, model, params = loaded
    if config != VARIANTS["dev"]:
        pytest.skip("one variant is enough")
    (tmp_path / "transformer").mkdir()
    (tmp_path / "transformer" / "config.json").write_text(json.dumps({
        "_class_name": "FluxTransformer2DModel", "guidance_embeds": True, "axes_dims_rope": [4, 6, 6]}))
    (tmp_path / "model_index.json").write_text(json.dumps({
        "_class_name": "FluxPipeline", "transformer": ["diffusers", "FluxTransformer2DModel"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}))
    FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, shift=3.0).save_pretrained(tmp_path / "scheduler")
    save_file(bfl_state, tmp_path / "flux1-dev.safetensors")
    parts, file_params, _ = single_file.read_single_file(FluxFiles, tmp_path / "flux1-dev.safetensors",
                                                         config=tmp_path)
    assert parts["transformer"].config == model.config
    assert_same_params(file_params["transformer"], params)
