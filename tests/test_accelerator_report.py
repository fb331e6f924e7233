"""scripts/accelerator_report.py on the CPU: the whole run on tiny models of the same architectures, so that the
code a GPU machine runs is run daily up to the device calls. Every section must hold numbers; no timing
thresholds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from compile_flags import xla_flags

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "accelerator_report.py"
sys.path.insert(0, str(SCRIPT.parent))
import accelerator_report as script  # noqa: E402

TIMES = ("first_call_s", "seconds_per_call", "seconds_per_call_min", "seconds_per_call_max", "seconds_per_image",
         "images_per_s", "flops_per_image", "tflops_per_s")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("accelerator")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1), "HF_HUB_OFFLINE": "1"}
    # No deadline: the script's (570 s by default) stops the jobs still running, which a slow or busy machine
    # reaches (it took 562 s on a loaded one); the timeout only guards against a hang.
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(folder / "report.json"), "--repeats", "1",
                           "--commit", "abc123", "--deadline-s", "7200"], env=env, cwd=folder, capture_output=True,
                          text=True, timeout=7200)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((folder / "report.json").read_text()), folder, done.stdout


def test_the_report_has_every_section_and_no_errors(report):
    r, folder, stdout = report
    assert r["schema"] == script.SCHEMA == 1 and r["errors"] == []
    p = r["provenance"]
    assert p["size"] == "tiny" and p["part"] == "all" and p["commit"] == "abc123"  # tiny: chosen on the CPU
    assert all(p["versions"][name] for name in ("jax", "jaxlib", "flax", "torch", "diffusers", "transformers"))
    assert (folder / "report.md").read_text().strip() == r["table"] == stdout.strip()
    assert not list(folder.glob("*.part"))


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_correctness_compares_every_model_in_both_dtypes(report, family):
    c = report[0]["correctness"][family]
    models = {"unet", "vae", "text_encoder", "text_encoder.last"}
    if family == "sdxl":
        models |= {"text_encoder_2", "text_encoder_2.last"}
    for dtype, bound in (("float32", script.FLOAT32_BOUND), ("bfloat16", None)):
        assert set(c[dtype]) == models
        for name, check in c[dtype].items():
            assert check["ok"] and check["finite"] and not check["constant"], (dtype, name, check)
            assert 0 < check["rel_l2"] <= check["bound"] and check["max_abs"] > 0, (dtype, name, check)
            if bound is not None:
                assert check["bound"] == bound
            else:  # bfloat16 is measured against diffusers' own bfloat16 error, which must be there
                assert check["bound"] == max(2 * check["diffusers_rel_l2"], script.BFLOAT16_FLOOR)
                assert 0 < check["against_diffusers_bfloat16"] < 0.1
    # on the CPU both attention settings are XLA's: the same program
    assert c["unet_attention"]["auto"]["ok"] and c["unet_attention"]["xla"]["ok"]
    assert c["unet_attention"]["auto_vs_xla_rel_l2"] == 0


def test_flux_parity_compares_the_image_and_the_transformer(report):
    """FLUX.1-dev's pipeline against diffusers' FluxPipeline, float32, on the same packed noise: the image of a few
    steps (one that varies, so the comparison means something) and the transformer's one evaluation."""
    c = report[0]["correctness"]["flux"]
    assert (c["image_size"], c["steps"], c["max_sequence_length"], c["prompts"]) == (64, 2, 32, 2)
    assert c["image_std"] > 0.05
    assert set(c["float32"]) == {"image", "transformer"}
    for name, check in c["float32"].items():
        assert check["ok"] and check["finite"] and not check["constant"], (name, check)
        assert 0 < check["rel_l2"] <= check["bound"] == script.FLOAT32_BOUND and check["max_abs"] > 0, (name, check)


def test_flux_configs_are_flux1_devs():
    """The speed rows' Flux is FLUX.1-dev's shapes: 12 billion transformer weights (19 double- and 38 single-stream
    blocks of 24 heads x 128), T5-XXL and CLIP-L; the parity models keep its widths with fewer blocks."""
    import jax

    from sdflax.cache import param_shapes
    from sdflax.loading.assemble import build_models

    full = script.FULL["flux"]
    assert full["size"] == 1024 and full["transformer"]["guidance_embeds"]
    assert [full["transformer"][k] for k in ("num_layers", "num_single_layers", "num_attention_heads",
                                              "attention_head_dim", "joint_attention_dim", "pooled_projection_dim",
                                              "in_channels", "axes_dims_rope")] == [19, 38, 24, 128, 4096, 768, 64,
                                                                                    [16, 56, 56]]
    assert (full["text_encoder_2"]["d_model"], full["text_encoder_2"]["num_layers"]) == (4096, 24)
    assert (full["text_encoder"]["hidden_size"], full["vae"]["latent_channels"]) == (768, 16)
    counts = {}
    for parity in (False, True):
        configs = script.configs_for("flux", "full", parity)
        modules = build_models({"transformer": script.model_classes("flux")["transformer"]}, configs, np.float32)
        counts[parity] = sum(x.size for x in jax.tree.leaves(param_shapes(modules["transformer"])))
    assert round(counts[False] / 1e9, 2) == 11.90 and round(counts[True] / 1e9, 2) == 0.69


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_attention_rows_name_the_kernel_and_its_error(report, family):
    rows = report[0]["correctness"][family]["attention"]
    configs = script.TINY[family]
    assert [(row["kind"], row["query_tokens"], row["key_tokens"], row["heads"], row["head_dim"]) for row in rows] \
        == script.attention_shapes(configs, configs["size"] // 8)
    for row in rows:
        assert row["kernel"] == "xla" and row["cudnn"] is None  # no cuDNN on the CPU
        assert row["xla"]["ok"] and 0 <= row["xla"]["rel_l2"] < script.BFLOAT16_FLOOR  # 0: one key, v itself


@pytest.mark.parametrize("family", ["sd15", "sdxl"])
def test_attention_shapes_are_diffusers_heads(family):
    """The report's attention shapes read diffusers' configs as diffusers does ("attention_head_dim" is the head
    count): the same (heads, head dim) pairs as the attention modules of diffusers' UNet."""
    import diffusers

    configs = script.TINY[family]
    unet = diffusers.UNet2DConditionModel(**configs["unet"])
    theirs = {(m.heads, m.inner_dim // m.heads) for name, m in unet.named_modules()
              if type(m).__name__ == "Attention"}
    ours = {(heads, head_dim) for _, _, _, heads, head_dim in script.attention_shapes(configs, 8)}
    assert ours == theirs
    full = {s[-1] for s in script.attention_shapes(script.FULL[family], script.FULL[family]["size"] // 8)}
    assert full == {"sd15": {40, 80, 160}, "sdxl": {64}}[family]


def test_speed_runs_have_numbers_and_ratios(report):
    r = report[0]
    runs = r["speed"]["runs"]
    assert [script.code_path(run) for run in runs] == [script.code_path(job) for job in script.jobs("all", "tiny")
                                                       if job["kind"] == "speed"]
    for run in runs:
        assert run["import_s"] > 0 and run["build_s"] > 0 and run["ready_s"] > run["import_s"] and run["wall_s"] > 0
        assert [x["batch"] for x in run["results"]] == run["batches"]
        for x in run["results"]:
            assert all(x[k] > 0 for k in TIMES), (run["framework"], x)
            assert x["seconds_per_call_min"] <= x["seconds_per_call"] <= x["seconds_per_call_max"]
            np.testing.assert_allclose(x["tflops_per_s"], x["flops_per_image"] * x["images_per_s"] / 1e12)
            assert x["peak_memory_bytes"] is None  # the CPU reports none
            plain = [b for b in runs if b["framework"] == "diffusers" and script.setting_key(b) ==
                     script.setting_key(run) and x["batch"] in b["batches"]]
            assert (x["speedup_vs_diffusers"] is not None) == bool(plain)
            if run["framework"] == "diffusers":
                assert x["speedup_vs_diffusers"] == 1
        if run["framework"] == "sdflax":  # one more call of the last batch, profiled: where its time went
            profile = run["profile"]
            assert profile["batch"] == run["batches"][-1] and profile["kernel_launches"] > 0, profile
            assert 0 < profile["device_busy_s"] and profile["wall_s"] > 0 and profile["lines"]
            assert sum(profile["categories_s"].values()) == pytest.approx(profile["device_busy_s"], rel=1e-6)
            assert profile["categories_s"]["convolution"] > 0  # the UNet's and the VAE's, named by XLA here
            top = [k["seconds"] for k in profile["top"]]
            assert top == sorted(top, reverse=True) and top[-1] > 0 and all(k["count"] > 0 for k in profile["top"])
    # FLUX.1-dev's row: sdflax against diffusers' FluxPipeline, each in its process, on the same noise
    assert [(run["framework"], run["batches"], run["height"], run["guidance"]) for run in runs
            if run["family"] == "flux"] == [("sdflax", [1], 64, 3.5), ("diffusers", [1], 64, 3.5)]
    cache = {run["cache"]: run["cache_hits"] for run in runs if run["framework"] == "sdflax"}
    assert cache["cold"] == 0 and cache["warm"] > 0 and cache["none"] == 0
    # the cold and warm processes load the checkpoint the run wrote, as a user's would; the others draw weights
    assert {run["cache"]: run.get("weights") for run in runs if run["framework"] == "sdflax"} == \
        {"cold": "checkpoint", "warm": "checkpoint", "none": None}
    written = r["speed"]["checkpoint"]
    assert written["family"] == "sd15" and written["bytes"] > 0 and written["wall_s"] > 0
    training_rows = sum(len(run["results"]) for run in r["training"])
    assert len(r["table"].splitlines()) == 4 + sum(len(run["results"]) for run in runs) + 3 + training_rows


def test_training_rows_time_sdflax_against_diffusers(report):
    """The LoRA update of sdflax.train and of diffusers' LoRA scripts (PEFT), each family, each in its process."""
    runs = report[0]["training"]
    assert [(run["framework"], run["family"]) for run in runs] == [
        ("sdflax", "sd15"), ("diffusers", "sd15"), ("sdflax", "sdxl"), ("diffusers", "sdxl")]
    for run in runs:
        (x,) = run["results"]
        assert run["import_s"] > 0 and run["build_s"] > 0 and run["wall_s"] > 0 and run["dtype"] == "float32"
        assert x["batch"] == run["batches"][0] == 2 and x["first_step_s"] > 0
        assert 0 < x["seconds_per_step_min"] <= x["seconds_per_step"] <= x["seconds_per_step_max"]
        np.testing.assert_allclose([x["steps_per_s"], x["images_per_s"]], [1, 2] / np.float64(x["seconds_per_step"]))
        (base,) = [b["results"][0] for b in runs if b["framework"] == "diffusers" and b["family"] == run["family"]]
        np.testing.assert_allclose(x["speedup_vs_diffusers"], x["steps_per_s"] / base["steps_per_s"])
        assert x["peak_memory_bytes"] is None and x["memory_vs_diffusers"] is None  # the CPU reports none


def test_flop_counts_add_up(report):
    counts = report[0]["speed"]["flops"]
    assert {(c["family"], c["steps"]) for c in counts} == {("sd15", 2), ("sdxl", 2), ("sd35", 2), ("flux", 2)}
    for c in counts:
        assert c["unet_evals"] >= c["steps"] and c["unet_eval_flops"] > 0 and c["vae_decode_flops"] > 0
        assert c["flops_per_image"] == c["unet_evals"] * c["unet_eval_flops"] + c["vae_decode_flops"]
        program = c["program"]  # the whole generate program, traced and lowered from the param shapes
        assert program["batch"] == 1 and program["trace_s"] > 0 and program["lower_s"] > 0
        assert program["stablehlo_bytes"] > program["stablehlo_lines"] > 1000


def test_the_compile_split_compiles_each_model_of_the_mlperf_setting(report):
    splits = report[0]["speed"]["compile_split"]
    assert [(s["family"], s["setting"], s["batch"]) for s in splits] == [("sdxl", "mlperf", 2)]
    models, one_layer = splits[0]["models"], splits[0]["one_layer"]
    assert set(models) == {"unet", "vae", "text_encoder", "text_encoder_2"}
    # the tiny UNet's deepest stack has two transformer layers, each CLIP two encoder layers: each cut to one
    assert set(one_layer) == {"unet", "text_encoder", "text_encoder_2"}
    for times in (*models.values(), *one_layer.values()):
        assert times["lower_s"] > 0 and times["compile_s"] > 0 and times["stablehlo_lines"] > 100, splits
    assert all(one_layer[name]["stablehlo_lines"] < models[name]["stablehlo_lines"] for name in one_layer), splits
    # the UNet with its stacks scanned: the deepest, of two layers, one loop body; both UNets run to one output
    scanned, runs = splits[0]["scanned"]["unet"], splits[0]["unet_runs"]
    assert scanned["lower_s"] > 0 and scanned["compile_s"] > 0, splits
    assert one_layer["unet"]["stablehlo_lines"] < scanned["stablehlo_lines"] < models["unet"]["stablehlo_lines"]
    for run in (runs["plain"], runs["scanned"]):
        assert run["first_call_s"] > 0 and run["seconds_per_call_min"] <= run["seconds_per_call"] <= \
            run["seconds_per_call_max"], runs
    # the same float32 products on the CPU; an output that varies, so the two agree on numbers
    assert runs["scanned_rel_l2"] <= 1e-6 and runs["output_std"] > 0.1, runs
    # on a GPU: the MLPerf batch, alone with `--part compile --family sdxl`
    assert [(j["kind"], j["batches"]) for j in script.jobs("compile", "full", "sdxl")] == [("compile_split", [8])]
    # SDXL's stacks of 2 and 10 transformer layers and CLIP's 12 and 32 encoder layers, one each
    cut = script.one_layer_configs(script.configs_for("sdxl", "full"))
    assert cut["unet"]["transformer_layers_per_block"] == [1, 1, 1]
    assert (cut["text_encoder"]["num_hidden_layers"], cut["text_encoder_2"]["num_hidden_layers"]) == (1, 1)
    assert "unet" not in script.one_layer_configs(script.configs_for("sd15", "full"))  # one layer a stack already


def test_scanned_stacks_keep_the_params_tree_and_the_unets_output():
    """The scanned UNet (an experiment of the report) reads the params the loaders fill, layer by layer, and
    computes what the UNet computes; outside its `with`, sdflax's UNet is back."""
    import jax
    from flax import traverse_util

    from sdflax.loading.assemble import build_models
    from sdflax.cache import param_shapes
    from sdflax.models import unet

    configs = script.configs_for("sdxl", "tiny")
    configs["unet"]["transformer_layers_per_block"] = [1, 3, 2]  # every stack of layers scanned, of two sizes
    classes = {"unet": script.model_classes("sdxl")["unet"]}
    plain = build_models(classes, configs, np.float32)["unet"]
    with script.scanned_transformer_stacks():
        scanned = build_models(classes, configs, np.float32)["unet"]
        shapes = param_shapes(scanned)
        params = script.random_params(scanned, np.float32)
        latents = jax.random.normal(jax.random.key(1), (2, 4, 8, 8))
        text = jax.random.normal(jax.random.key(2), (2, 77, 64))
        args = (params, latents, np.float32(500.0), text)
        extra = {"text_embeds": jax.random.normal(jax.random.key(3), (2, 32)),
                 "time_ids": jax.random.normal(jax.random.key(4), (2, 6)) * 100}
        lowered = jax.jit(scanned.apply).lower(*args, **extra)
        ours = lowered.compile()(*args, **extra)
    lines = lowered.as_text()
    assert unet.Transformer2DModel.__name__ == "Transformer2DModel"
    flat = lambda tree: {k: v.shape for k, v in traverse_util.flatten_dict(tree).items()}  # noqa: E731
    assert flat(shapes) == flat(param_shapes(plain))
    stacks = {k[:-2] for k in traverse_util.flatten_dict(shapes) if "proj_in" in k}
    assert lines.count("stablehlo.while") == len(stacks) == 7  # one loop a stack (the CPU's attention has none here)
    theirs = jax.jit(plain.apply)(*args, **extra)
    assert float(np.std(theirs)) > 0.1
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["sd15", "sdxl", "sd35", "flux"])
def test_model_calls_are_the_pipelines_calls(family):
    """Each family's models as `compile_split` compiles them (and `flop_count` counts two of them): every model of
    the pipeline, on its inputs' shapes at a batch of three (six guidance rows), lowered from the param shapes."""
    import jax

    from sdflax.loading.assemble import build_models
    from sdflax.cache import param_shapes

    configs = script.configs_for(family, "tiny")
    modules = build_models(script.model_classes(family), configs, np.float32)
    calls = script.model_calls(modules, configs, batch=3)
    assert set(calls) == set(modules)
    for name, (function, inputs, keywords) in calls.items():
        assert jax.jit(function).lower(param_shapes(modules[name]), *inputs, **keywords).as_text(), name
        rows = [x.shape[0] for x in (*inputs, *keywords.values()) if x.shape]
        # Flux's transformer: no guidance batch, the guidance an input
        single = name == "vae" or (family, name) == ("flux", "transformer")
        assert set(rows) == ({3} if single else {6}), (name, rows)


def test_the_tiny_run_covers_every_code_path_of_the_gpu_run():
    full = script.jobs("all", "full")
    assert {script.code_path(j) for j in full} == {script.code_path(j) for j in script.jobs("all", "tiny")}
    parts = [job for part in ("correctness", "sd15", "sdxl", "sd35", "flux", "compile", "train")
             for job in script.jobs(part, "full")]
    assert all(job in parts for job in full)
    # the settings
    settings = {(j["family"], j.get("setting"), j["steps"], j["guidance"], tuple(j.get("batches", ()))) for j in full
                if j["kind"] == "speed"}
    assert {("sd15", None, 50, 7.5, (1, 8)), ("sdxl", None, 30, 5.0, (1,)), ("sdxl", "mlperf", 20, 8.0, (8,)),
            ("sd35", None, 28, 7.0, (1,)), ("flux", None, 28, 3.5, (1,)), ("flux", None, 28, 3.5, (4,))} <= settings
    # training: SD 1.5 LoRA 512² batch 8 and SDXL LoRA 1024² batch 2, bf16, sdflax against diffusers
    assert [(j["framework"], j["family"], script.FULL[j["family"]]["size"], j["batches"], j["mixed_precision"])
            for j in full if j["kind"] == "train"] == [
        ("sdflax", "sd15", 512, [8], "bf16"), ("diffusers", "sd15", 512, [8], "bf16"),
        ("sdflax", "sdxl", 1024, [2], "bf16"), ("diffusers", "sdxl", 1024, [2], "bf16")]
    # SD 3.5 Medium: sdflax against diffusers, at 1024x1024 as the issue asks
    assert [(j["framework"], j["batches"]) for j in script.jobs("sd35", "full")] == [("sdflax", [1]),
                                                                                    ("diffusers", [1])]
    assert script.FULL["sd35"]["size"] == 1024 and [j["family"] for j in script.jobs("all", "full", "sd35")] == \
        ["sd35", "sd35"]
    # FLUX.1-dev at 1024x1024: its parity, then sdflax against diffusers at batch 1, then at batch 4 (last, and
    # alone with --batch 4); the whole part last in `all`
    flux = script.jobs("flux", "full")
    assert [(j["kind"], j.get("framework"), j.get("batches")) for j in flux] == [
        ("correctness", None, None), ("speed", "sdflax", [1]), ("speed", "diffusers", [1]), ("speed", "sdflax", [4]),
        ("speed", "diffusers", [4])]
    assert script.FULL["flux"]["size"] == 1024 and full[-len(flux):] == flux == script.jobs("all", "full", "flux")
    assert [(j["framework"], j["batches"]) for j in script.jobs("flux", "full", batch=4)] == [("sdflax", [4]),
                                                                                             ("diffusers", [4])]


def test_sd35_configs_are_sd35_mediums():
    """The report's SD 3.5 Medium is scripts/benchmark.py's, the published configs: the same models, field by
    field, wherever the report leaves a key to the class's default."""
    import benchmark

    from sdflax.models import AutoencoderKL, CLIPTextModelWithProjection, SD3Transformer2DModel, T5EncoderModel

    for name, cls in (("transformer", SD3Transformer2DModel), ("vae", AutoencoderKL),
                      ("text_encoder", CLIPTextModelWithProjection), ("text_encoder_2", CLIPTextModelWithProjection),
                      ("text_encoder_3", T5EncoderModel)):
        ours, published = (cls.config_class.from_dict(c[name]) for c in (script.FULL["sd35"], benchmark.SD35_MEDIUM))
        assert ours == published, name
    assert script.FULL["sd35"]["scheduler"] == benchmark.SD35_MEDIUM["scheduler"]


def test_an_existing_report_is_never_overwritten(tmp_path):
    out = tmp_path / "report.json"
    out.write_text("mine")
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "exists: give a new file" in done.stderr
    assert out.read_text() == "mine"


def test_batch_keeps_the_speed_jobs_timing_that_batch_size_at_that_size_alone():
    jobs = script.jobs("sd15", "full", batch=4)
    assert [(j["framework"], j["batches"]) for j in jobs] == [("sdflax", [4]), ("diffusers", [4])]
    assert [j["batches"] for j in script.jobs("sd15", "full", batch=8)] == [[8], [8]]
    assert script.jobs("correctness", "full", batch=1) == []


def test_the_flags_part_times_each_flag_set_against_xlas_defaults(monkeypatch):
    jobs = script.jobs("flags", "full")
    assert [j.get("xla_flags") for j in jobs if j["family"] == "sd15"] == [None, *script.XLA_FLAG_SETS]
    mlperf = script.jobs("flags", "full", "sdxl")  # the longest compile: the compile-time flag sets first
    assert all(j["setting"] == "mlperf" and j["batches"] == [8] for j in mlperf)
    assert [j.get("xla_flags") for j in mlperf][:4] == [None, *script.COMPILE_FLAG_SETS]
    assert sorted(j.get("xla_flags") or "" for j in mlperf) == sorted(["", *script.XLA_FLAG_SETS])
    # a job's flags are added to the user's XLA_FLAGS in its process's environment, never replacing them
    monkeypatch.setenv("XLA_FLAGS", "--mine")
    assert script.job_environment(jobs[1])["XLA_FLAGS"] == "--mine " + script.XLA_FLAG_SETS[jobs[1]["xla_flags"]]
    assert script.job_environment(jobs[0])["XLA_FLAGS"] == "--mine"
    assert script.job_environment({"kind": "flops"})["JAX_PLATFORMS"] == "cpu"  # a FLOP count needs no device


def test_jobs_run_in_order_on_one_lane_and_after_what_they_need_on_two(monkeypatch):
    """The scheduling alone (processes that end on their third look): one lane runs the plan in order; two run
    at most two at once, each job after the jobs whose files it reads (the checkpoint, the cold compile cache)."""
    from accelerator_report import processes as script  # the module whose JobProcess run_jobs starts

    tasks = script.plan(script.jobs("all", "tiny"), "cache", "checkpoint")
    kinds = [(t["kind"], t.get("cache")) for t in tasks]
    checkpoint, cold, warm = (kinds.index(k) for k in (("checkpoint", None), ("speed", "cold"), ("speed", "warm")))
    assert checkpoint < cold < warm and script.needs(tasks[cold], tasks[:cold]) == [checkpoint]
    assert script.needs(tasks[warm], tasks[:warm]) == [checkpoint, cold]
    assert {t["cache_dir"] for t in tasks if "cache_dir" in t} == {"cache"}
    assert sorted((t["family"], t["steps"]) for t in tasks if t["kind"] == "flops") == \
        [("flux", 2), ("sd15", 2), ("sd35", 2), ("sdxl", 2)]  # one FLOP count a setting
    events = []

    class Ends:
        def __init__(self, job, args, fork):
            self.index, self.looks = tasks.index(job), 0
            events.append(("start", self.index))

        def done(self):
            self.looks += 1
            return self.looks >= 3

        def result(self):
            events.append(("end", self.index))
            return {"index": self.index}

    monkeypatch.setattr(script, "JobProcess", Ends)
    monkeypatch.setattr(script.time, "sleep", lambda s: None)
    for lanes in (1, 2):
        events.clear()
        results = dict(script.run_jobs(tasks, None, deadline=float("inf"), lanes=lanes))
        assert results == {i: {"index": i} for i in range(len(tasks))}
        started = [i for event, i in events if event == "start"]
        assert sorted(started) == list(range(len(tasks)))
        running = most = 0
        for event, i in events:
            running += 1 if event == "start" else -1
            most = max(most, running)
            if event == "start":
                ended = {j for e, j in events[:events.index((event, i))] if e == "end"}
                assert set(script.needs(tasks[i], tasks[:i])) <= ended
        assert most == lanes
        if lanes == 1:
            assert started == list(range(len(tasks))) and events[1::2] == [("end", i) for i in started]


def test_forked_jobs_report_errors_run_two_at_once_and_stop_at_the_deadline(tmp_path):
    """The CPU run's forked jobs, two at once: a job that raises comes back as its traceback's tail; one that
    outlasts the deadline is stopped there, and the job that needs its files is not run; a result comes from a
    process of its own, while the slow job still runs; a fresh interpreter's error and deadline are a fork's.
    Forked from a fresh process, as the script forks from its own (never from a test worker whose JAX may have
    started its threads). The deadline passes once the last job's process has started (it writes a file), not at
    a time: on any machine, however slow or busy, the jobs before it have ended by then."""
    code = """if True:
        import json, os, sys, time
        sys.path.insert(0, sys.argv[1])
        from accelerator_report import processes as script
        started = sys.argv[2]  # the slow job writes it as it starts

        class WhenTheSlowJobRuns:
            \"\"\"A deadline as run_jobs compares it with time.perf_counter(): passed once `started` exists.\"\"\"
            at = None

            def passed(self, now):
                if self.at is None and os.path.exists(started):
                    self.at = now
                return self.at is not None

            def __gt__(self, now):  # now < deadline
                return not self.passed(now)

            def __lt__(self, now):  # now > deadline
                return self.passed(now)

        def work(job, args):
            if job["kind"] == "fail":
                raise ValueError("no such model")
            if job["kind"] == "checkpoint":
                time.sleep(600)
            return {"pid": os.getpid()}

        script.work = work
        command = script.worker_command
        script.worker_command = lambda job, args: [
            sys.executable, "-c", f"import time; open({started!r}, 'w').close(); time.sleep(600)"] \\
            if job["kind"] == "slow" else command(job, args)
        args = script.argparse.Namespace(size="tiny", repeats=1)
        jobs = [{"kind": "fail"}, {"kind": "checkpoint", "family": "sd15"}, {"kind": "pid"},
                {"kind": "pid", "weights": "checkpoint"}, {"kind": "unknown", "cache": "cold"},
                {"kind": "slow", "cache": "cold"}]
        start, deadline = time.perf_counter(), WhenTheSlowJobRuns()
        ended = [(i, result, time.perf_counter() - start)
                 for i, result in script.run_jobs(jobs, args, deadline=deadline, fork=True, lanes=2)]
        print(json.dumps({"parent": os.getpid(), "ended": ended, "deadline": deadline.at - start}))
    """
    done = subprocess.run([sys.executable, "-c", code, str(SCRIPT.parent), str(tmp_path / "started")],
                          capture_output=True, text=True, timeout=600)  # a hang guard
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    ended, deadline = {i: (result, seconds) for i, result, seconds in out["ended"]}, out["deadline"]
    assert [i for i, _, _ in out["ended"] if i in (0, 1, 2, 3)] == [0, 2, 1, 3]
    (failed, _), (stopped, stopped_at), (ran, ran_at), (not_run, _), (fresh, _), (slow, slow_at) = \
        (ended[i] for i in range(6))
    assert failed["error"].startswith("exit 1: ") and "ValueError: no such model" in failed["error"]
    assert stopped["error"] == "stopped at the deadline" and deadline <= stopped_at
    assert ran["pid"] != out["parent"] and ran["wall_s"] > 0 and ran_at < deadline
    assert not_run == {"error": "not run, past the deadline"}
    # a job that times its process's start runs in a fresh interpreter, the real script's: its traceback's tail
    assert fresh["error"].startswith("exit 1: ") and "KeyError: 'unknown'" in fresh["error"]
    assert slow["error"] == "stopped at the deadline" and deadline <= slow_at  # and stopped as a fork is


@pytest.mark.parametrize("name, category", [
    # cuDNN's flash attention, convolution and cuBLAS kernels on an H100, XLA's custom calls and fusions
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x64x64_4x1x1_kernel0_0", "attention"),
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", "convolution"),
    ("cudnn-conv-bias-activation.12", "convolution"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1", "matmul"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"),
    ("gemm_fusion_dot.3", "matmul"),
    ("loop_convert_fusion_4", "other"),  # "convert" is no convolution
    ("input_reduce_fusion_12", "other"),
    ("MemcpyD2H", "memory"),
    ("conv_general_dilated.123", "convolution"),  # the CPU's
])
def test_profile_categories(name, category):
    assert script.kernel_category(name) == category
