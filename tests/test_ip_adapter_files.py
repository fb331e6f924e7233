"""IP-Adapter files as h94 writes them (.safetensors and .bin), read by `read_ip_adapter`: the image projections equal
diffusers' (its converter of h94's names, loaded into its modules), the to_k_ip / to_v_ip kernels are the file's,
and a file that is not an IP-Adapter is one line."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from builders import h94_names, randomize_norms
from safetensors.torch import save_file

from sdflax.loading.ip_adapter import IPAdapterFileError, read_ip_adapter

# float32 parity: the largest difference is at most 1e-5 of the output's largest magnitude (the same sums in
# another order).
RTOL = 1e-5

# Scaled-down projections: IP-Adapter (CLIP embedding 32 -> 4 tokens of 24), Full Face (hidden states 32 -> 24),
# Plus (hidden states 48 -> a 4-layer resampler of width 64, 2 heads of 64, 6 queries -> 24; diffusers' converter
# builds 4 layers and reads heads as to_q's width // 64).
CROSS = 24


def torch_projection(kind):
    from diffusers.models.embeddings import (
        ImageProjection, IPAdapterFullImageProjection, IPAdapterPlusImageProjection)

    torch.manual_seed(0)
    if kind == "base":
        return randomize_norms(ImageProjection(32, CROSS, 4), seed=1).eval(), (2, 32)
    if kind == "full":
        return randomize_norms(IPAdapterFullImageProjection(32, CROSS), seed=1).eval(), (2, 5, 32)
    module = IPAdapterPlusImageProjection(embed_dims=48, output_dims=CROSS, hidden_dims=64, depth=4, heads=2,
                                          num_queries=6)
    return randomize_norms(module, seed=1).eval(), (2, 5, 48)


@pytest.fixture(scope="module", params=["base", "full", "plus"])
def adapter(request):
    """(kind, h94's {"image_proj": ..., "ip_adapter": ...}, input shape)."""
    kind = request.param
    module, input_shape = torch_projection(kind)
    g = torch.Generator().manual_seed(2)
    ip = {f"{i}.to_{kv}_ip.weight": torch.randn(hidden, CROSS, generator=g)
          for i, hidden in ((1, 16), (3, 16), (5, 40)) for kv in "kv"}
    return kind, {"image_proj": h94_names(kind, module.state_dict()), "ip_adapter": ip}, input_shape


@pytest.fixture(scope="module", params=["safetensors", "bin"])
def written(request, adapter, tmp_path_factory):
    kind, content, _ = adapter
    path = tmp_path_factory.mktemp("ip") / f"ip-adapter_{kind}.{request.param}"
    if request.param == "bin":
        torch.save(content, path)
    else:
        save_file({f"{s}.{k}": v.contiguous() for s, d in content.items() for k, v in d.items()}, str(path))
    return path


def test_projection_equals_diffusers(adapter, written):
    from diffusers import UNet2DConditionModel

    kind, content, input_shape = adapter
    theirs = UNet2DConditionModel._convert_ip_adapter_image_proj_to_diffusers(
        None, dict(content["image_proj"]), low_cpu_mem_usage=False).eval()
    x = np.random.default_rng(0).standard_normal(input_shape, dtype=np.float32)
    with torch.no_grad():
        expected = theirs(torch.from_numpy(x)).numpy()

    ours = read_ip_adapter(written)
    got = np.asarray(jax.jit(ours.projection.apply)({"params": ours.projection_params}, x))
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=RTOL * np.abs(expected).max())
    assert ours.wants_hidden_states == (kind != "base")
    assert ours.num_tokens == {"base": 4, "full": 257, "plus": 6}[kind]


def test_ip_kernels_are_the_files(adapter, written):
    _, content, _ = adapter
    ours = read_ip_adapter(written)
    for kv, kernels in (("k", ours.to_k_ip), ("v", ours.to_v_ip)):
        assert len(kernels) == 3
        for i, kernel in zip((1, 3, 5), kernels):
            np.testing.assert_array_equal(np.asarray(kernel), content["ip_adapter"][f"{i}.to_{kv}_ip.weight"].numpy().T)


BAD = {
    "lora.safetensors": ({"lora_unet_down.weight": torch.zeros(2, 2)}, "expected tensors under image_proj"),
    "faceid.safetensors": ({"image_proj.proj.0.weight": torch.zeros(4, 2), "image_proj.norm.weight": torch.zeros(2),
                            "ip_adapter.1.to_k_ip.weight": torch.zeros(2, 2)}, "FaceID"),
    "other.safetensors": ({"image_proj.foo.weight": torch.zeros(2), "ip_adapter.1.to_k_ip.weight": torch.zeros(2, 2)},
                          "expected proj.weight"),
    "gap.safetensors": ({"image_proj.proj.weight": torch.zeros(8, 3), "image_proj.proj.bias": torch.zeros(8),
                         "image_proj.norm.weight": torch.zeros(2),
                         "image_proj.norm.bias": torch.zeros(2), "ip_adapter.3.to_k_ip.weight": torch.zeros(5, 2),
                         "ip_adapter.3.to_v_ip.weight": torch.zeros(5, 2)}, "1, 3, 5"),
    "nan.safetensors": ({"image_proj.proj.weight": torch.zeros(8, 3), "image_proj.proj.bias": torch.zeros(8),
                         "image_proj.norm.weight": torch.zeros(2), "image_proj.norm.bias": torch.zeros(2),
                         "ip_adapter.1.to_k_ip.weight": torch.zeros(5, 2).index_fill(1, torch.tensor([1]), torch.nan),
                         "ip_adapter.1.to_v_ip.weight": torch.zeros(5, 2)},
                        "NaN or inf in ip_adapter.1.to_k_ip.weight"),
    "flat.bin": ({"image_proj.proj.weight": torch.zeros(8, 3)}, "expected tensors under image_proj"),
    "adapter.pt": ({"image_proj.proj.weight": torch.zeros(8, 3)}, "unknown suffix"),
}


@pytest.mark.parametrize("file", sorted(BAD))
def test_bad_file_is_one_line(file, tmp_path):
    tensors, expected = BAD[file]
    path = tmp_path / file
    torch.save(tensors, path) if file.endswith(".bin") else save_file(tensors, str(path))
    with pytest.raises(IPAdapterFileError) as error:
        read_ip_adapter(path)
    message = str(error.value)
    assert "\n" not in message and str(path) in message and expected in message
