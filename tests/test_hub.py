"""Model resolution without network: a fake Hugging Face cache laid out as huggingface_hub lays it out."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import numpy as np
import pytest
from huggingface_hub.utils import filter_repo_objects
from PIL import Image
from compile_flags import xla_flags

from sdflax import AutoencoderKL, StableDiffusion
from sdflax.loading.hub import ModelNotFoundError, resolve_folder, snapshot_commit
from sdflax.loading.folders import check_pipeline_folder
from sdflax.loading.folders import checkpoint_files, model_files

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "weights" / "tiny-sd"
COMMIT = "0123456789abcdef0123456789abcdef01234567"

# stable-diffusion-v1-5/stable-diffusion-v1-5 on the hub (main): every format, ~45 GB in all.
SD15_FILES = """
.gitattributes README.md v1-5-pruned.ckpt v1-5-pruned.safetensors v1-5-pruned-emaonly.ckpt
v1-5-pruned-emaonly.safetensors v1-inference.yaml model_index.json feature_extractor/preprocessor_config.json
safety_checker/config.json safety_checker/model.safetensors safety_checker/model.fp16.safetensors
safety_checker/pytorch_model.bin safety_checker/pytorch_model.fp16.bin scheduler/scheduler_config.json
text_encoder/config.json text_encoder/model.safetensors text_encoder/model.fp16.safetensors
text_encoder/pytorch_model.bin text_encoder/pytorch_model.fp16.bin tokenizer/merges.txt
tokenizer/special_tokens_map.json tokenizer/tokenizer_config.json tokenizer/vocab.json unet/config.json
unet/diffusion_pytorch_model.safetensors unet/diffusion_pytorch_model.fp16.safetensors
unet/diffusion_pytorch_model.non_ema.safetensors unet/diffusion_pytorch_model.bin
unet/diffusion_pytorch_model.fp16.bin unet/diffusion_pytorch_model.non_ema.bin vae/config.json
vae/diffusion_pytorch_model.safetensors vae/diffusion_pytorch_model.fp16.safetensors
vae/diffusion_pytorch_model.bin vae/diffusion_pytorch_model.fp16.bin
""".split()


def test_only_the_files_the_pipeline_reads_are_downloaded():
    chosen = set(filter_repo_objects(SD15_FILES, allow_patterns=checkpoint_files()))
    weights = {f for f in chosen if not f.endswith((".json", ".txt"))}
    assert weights == {"unet/diffusion_pytorch_model.safetensors", "vae/diffusion_pytorch_model.safetensors",
                       "text_encoder/model.safetensors"}
    assert {"model_index.json", "scheduler/scheduler_config.json", "tokenizer/vocab.json", "tokenizer/merges.txt",
            "unet/config.json", "vae/config.json", "text_encoder/config.json"} <= chosen
    # Sharded checkpoints still match; fp16 shards only with variant="fp16".
    shards = ["unet/diffusion_pytorch_model-00001-of-00002.safetensors",
              "unet/diffusion_pytorch_model.safetensors.index.json",
              "unet/diffusion_pytorch_model.fp16-00001-of-00002.safetensors"]
    assert list(filter_repo_objects(shards, allow_patterns=checkpoint_files())) == shards[:2]
    assert list(filter_repo_objects(shards, allow_patterns=checkpoint_files("fp16"))) == shards[2:]


# openai/clip-vit-large-patch14 on the hub (main): its weights in four formats, 6.8 GB in all
CLIP_L_FILES = """
.gitattributes README.md config.json flax_model.msgpack merges.txt model.safetensors preprocessor_config.json
pytorch_model.bin special_tokens_map.json tf_model.h5 tokenizer.json tokenizer_config.json vocab.json
""".split()


def test_a_model_downloads_its_config_and_one_weight_format():
    assert set(filter_repo_objects(CLIP_L_FILES, allow_patterns=model_files())) == {"config.json", "model.safetensors"}
    vae = [f for f in SD15_FILES if f.startswith("vae/")]
    assert set(filter_repo_objects(vae, allow_patterns=model_files("vae"))) == {
        "vae/config.json", "vae/diffusion_pytorch_model.safetensors"}


@pytest.fixture
def hf_cache(tmp_path, monkeypatch):
    """models--org--name/{refs/main, snapshots/<commit>/...} holding tiny-sd, offline (huggingface_hub reads its
    environment at import, so the in-process settings are patched; subprocesses get `env`)."""
    cache = tmp_path / "hub"
    repo = cache / "models--org--name"
    shutil.copytree(TINY, repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return cache, env


def test_from_pretrained_reads_a_hub_id_from_the_cache(hf_cache):
    folder = resolve_folder("org/name", allow_patterns=checkpoint_files())
    assert Path(folder) == hf_cache[0] / "models--org--name" / "snapshots" / COMMIT
    assert snapshot_commit(folder) == COMMIT and snapshot_commit(TINY) is None
    assert resolve_folder("org/name", revision=COMMIT) == folder
    pipeline, params = StableDiffusion.from_pretrained("org/name")
    _, expected = StableDiffusion.from_pretrained(str(TINY))
    np.testing.assert_array_equal(params["unet"]["conv_in"]["kernel"], expected["unet"]["conv_in"]["kernel"])
    assert pipeline.vae_scale_factor == 4
    _, vae = AutoencoderKL.from_pretrained("org/name", subfolder="vae")  # a model of the repo, as the pipeline's
    np.testing.assert_array_equal(vae["decoder"]["conv_out"]["kernel"], expected["vae"]["decoder"]["conv_out"]["kernel"])


def test_uncached_id_offline_says_so_and_how_to_fix_it(hf_cache):
    with pytest.raises(ModelNotFoundError) as e:
        resolve_folder("org/missing")
    message = str(e.value)
    assert "org/missing is not in the Hugging Face cache" in message and str(hf_cache[0]) in message
    assert "HF_HUB_OFFLINE=1" in message and "run once without HF_HUB_OFFLINE" in message
    assert "\n" not in message
    with pytest.raises(ModelNotFoundError, match="org/name at revision 'v2' is not in the Hugging Face cache"):
        resolve_folder("org/name", revision="v2")
    # A mistyped local path reads as a hub id: the message says there is no such folder either.
    with pytest.raises(ModelNotFoundError, match="no local folder 'weights/tiny-sdx'"):
        resolve_folder("weights/tiny-sdx")


def test_paths_and_folders_that_are_not_checkpoints(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such folder"):
        resolve_folder(str(tmp_path / "nowhere"))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="is a file: sdflax reads diffusers-layout folders"):
        resolve_folder(str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelNotFoundError, match="neither a folder nor a hub id"):
        resolve_folder("not a model")
    partial = tmp_path / "partial"
    shutil.copytree(TINY, partial)
    (partial / "tokenizer" / "merges.txt").unlink()
    (partial / "scheduler" / "scheduler_config.json").unlink()
    with pytest.raises(ModelNotFoundError, match=r"missing scheduler/scheduler_config.json, tokenizer/vocab.json"):
        check_pipeline_folder(str(partial))
    check_pipeline_folder(str(TINY))


def test_a_missing_tokenizer_is_named_before_the_weights_are_read(tmp_path):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(TINY, folder)
    shutil.rmtree(folder / "tokenizer")
    with pytest.raises(FileNotFoundError, match=r"no tokenizer folder at .*no-tokenizer.tokenizer"):
        StableDiffusion.from_pretrained(str(folder))


def run_cli(args, env, tmp):
    env = {**env, "XLA_FLAGS": xla_flags(1), "JAX_PLATFORMS": "cpu",
           "SDFLAX_CACHE_DIR": str(tmp / "jax-cache")}
    return subprocess.run([sys.executable, "-m", "sdflax", "generate", *args], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_loads_a_hub_id_from_the_cache(hf_cache, tmp_path):
    result = run_cli(["a fox", "--model", "org/name", "--steps", "1", "--height", "32", "--width", "32",
                      "--seed", "7", "--no-progress", "--out", "fox.png"], hf_cache[1], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["fox.png"]
    image = Image.open(tmp_path / "fox.png")
    assert image.size == (32, 32)
    assert (image.text["model"], image.text["revision"], image.text["commit"]) == ("org/name", "main", COMMIT)


def test_cli_uncached_id_offline_is_one_line_and_status_2(hf_cache, tmp_path):
    result = run_cli(["a fox", "--model", "org/missing", "--out", "out"], hf_cache[1], tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith("sdflax: error: org/missing is not in the Hugging Face cache")
    assert "HF_HUB_OFFLINE" in result.stderr and result.stdout == ""


def load_download_script():
    spec = importlib.util.spec_from_file_location("download_weights", ROOT / "scripts" / "download_weights.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_download_script_fetches_the_pipeline_files_into_weights(tmp_path, monkeypatch, capsys):
    calls = []

    def fake_snapshot_download(repo_id, revision=None, allow_patterns=None, local_dir=None, **kwargs):
        calls.append((repo_id, revision, allow_patterns, local_dir))
        shutil.copytree(TINY, local_dir, dirs_exist_ok=True)
        return local_dir

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    script = load_download_script()
    assert script.WEIGHTS == str(ROOT / "weights")
    assert script.main(["org/sd-model", "--revision", "v1", "--dest", str(tmp_path)]) == 0
    folder = str(tmp_path / "sd-model")
    assert calls == [("org/sd-model", "v1", checkpoint_files(), folder)]
    assert capsys.readouterr().out.split() == [folder]
    StableDiffusion.from_pretrained(folder)  # what it wrote loads


def test_download_script_errors_are_one_line(hf_cache, tmp_path, capsys):
    assert load_download_script().main(["org/missing", "--dest", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("download_weights: error: org/missing is not in the Hugging Face cache")
    assert err.count("\n") == 1
