"""The shape of the package: no import cycles between sdflax's modules, the models import nothing above them, no
module over 500 lines or using another's private names, and the documented layout (docs/design.md) names its files."""

from __future__ import annotations

import ast
import re

from builders import REPO

PACKAGE = REPO / "sdflax"


def module_name(path):
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path):
    """The sdflax modules `path` imports, at the top or inside functions (a lazy import is still a dependency)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t.startswith("sdflax"))
    return found


def test_no_import_cycle():
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: {t for t in imports_of(path) if t in modules and t != name} for name, path in modules.items()}
    # A package imports its own submodules in __init__; a submodule importing a sibling via the package is fine.
    graph = {name: {t for t in deps if not name.startswith(t + ".")} for name, deps in graph.items()}
    state = {}

    def visit(name, trail):
        state[name] = "open"
        for dep in sorted(graph[name]):
            if state.get(dep) == "open":
                cycle = trail[trail.index(dep):] + [dep] if dep in trail else [name, dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, trail + [dep])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])


def test_models_import_nothing_above_them():
    """The models are the bottom floor: loading, the cache and the hub build on them, never the other way. Their
    `from_pretrained` / `from_single_file` import the loader when called (nothing registers it at import time), and
    nothing else of theirs reaches up. sdflax/lazy.py (the packages' names imported on first use) is below every
    floor: it imports nothing of sdflax."""
    assert [t for t in imports_of(PACKAGE / "lazy.py") if t.startswith("sdflax")] == []
    entry_points = {"from_pretrained", "from_single_file"}
    for path in (PACKAGE / "models").glob("*.py"):
        tree = ast.parse(path.read_text())
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in entry_points]
        lazy = {id(node) for call in calls for node in ast.walk(call) if isinstance(node, ast.ImportFrom)}
        reached = {f"{node.module} in {path.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                   and node.level > 1 and id(node) not in lazy and node.module != "lazy"}
        assert reached == set()
        assert {node.module.split(".")[0] for node in ast.walk(tree) if id(node) in lazy} <= {"loading"}, path.name
        outside = {t for t in imports_of(path) if not t.startswith(("sdflax.models", "sdflax.lazy"))}
        assert {t for t in outside if not t.startswith("sdflax.loading.")} == set(), path.name


def test_nothing_registers_at_import_time():
    """`import sdflax` imports no loader (the models find theirs when called), and no module under sdflax/ sets
    another module's attribute at import time."""
    import subprocess
    import sys

    code = "import sys, sdflax; print(sorted(m for m in sys.modules if m.startswith(('sdflax.loading.folders', " \
           "'sdflax.loading.single_file', 'sdflax.loading.hub', 'sdflax.loading.assemble'))))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=REPO).stdout.strip() == "[]"
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        assigned = [ast.unparse(target) for node in tree.body if isinstance(node, ast.Assign)
                    for target in node.targets if isinstance(target, ast.Attribute)]
        assert assigned == [], path


def test_a_pipeline_class_imports_only_what_it_uses():
    """`from sdflax import StableDiffusion` and its checkpoint's scheduler load one scheduler, no other family's text
    or image encoders and no guider but the base (sdflax/lazy.py): the start a user pays for (issue: a light start)."""
    import subprocess
    import sys

    code = ("import sys\nfrom sdflax import StableDiffusion\nfrom sdflax.schedulers import scheduler_from_config\n"
            "scheduler_from_config({'_class_name': 'PNDMScheduler'})\n"
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('sdflax.'))))")
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                cwd=REPO).stdout.split())
    schedulers = {m for m in loaded if m.startswith("sdflax.schedulers.")}
    assert schedulers == {f"sdflax.schedulers.{m}" for m in ("common", "names", "pndm", "protocol", "sigma_schedules")}
    assert {f"sdflax.models.{m}" for m in ("t5", "siglip", "clip_vision", "inception", "sd3_controlnet",
                                           "flux_controlnet")} & loaded == set()
    assert {m for m in loaded if m.startswith("sdflax.guiders.")} <= {"sdflax.guiders.base", "sdflax.guiders.perturbed"}
    assert not any(m.startswith(("sdflax.train", "sdflax.metrics", "sdflax.cli")) for m in loaded)


def test_at_most_ten_modules_directly_under_sdflax():
    assert len(list(PACKAGE.glob("*.py"))) <= 10


def test_no_module_over_500_lines():
    long = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_no_module_uses_another_modules_private_names():
    """`from sdflax.x import _name` or `x._name` on an imported sdflax module: a private name shared is a public
    one, and should be named so."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text())
        imported = {}  # local name -> sdflax module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith("sdflax"):
                    continue
                for alias in node.names:
                    if alias.name.startswith("_") and base != name:
                        found.append(f"{name} imports {base}.{alias.name}")
                    if f"{base}.{alias.name}" in modules:
                        imported[alias.asname or alias.name] = f"{base}.{alias.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.attr.startswith("_")
                    and not node.attr.startswith("__") and imported.get(node.value.id, name) != name):
                found.append(f"{name} uses {imported[node.value.id]}.{node.attr}")
    assert found == []


def test_documented_layout_names_every_module():
    block = re.search(r"## Layout\n\n```\n(.*?)```", (REPO / "docs" / "design.md").read_text(), re.S).group(1)
    named = set()
    for line in block.splitlines():
        if line.startswith(" "):  # an entry's description continued
            continue
        entry = line.split("  ")[0]
        for part in entry.split(", "):
            named.add(part if "/" in part else f"sdflax/{part}")
    files = {f"sdflax/{p.name}" for p in PACKAGE.glob("*.py") if p.name not in ("__init__.py", "__main__.py")}
    folders = {f"sdflax/{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert files | folders == named


def test_inputs_are_the_core_fields_and_one_mapping_of_conditionings():
    """A conditioning brings its own inputs (`Inputs.conditions[key]`), not fields of `Inputs`."""
    import dataclasses

    from sdflax.pipeline.types import Inputs

    names = [field.name for field in dataclasses.fields(Inputs)]
    assert len(names) <= 24 and "conditions" in names
    assert not [name for name in names if name.startswith(("control", "adapter", "ip_adapter", "skip_layer"))]


def test_no_function_of_the_pipeline_layer_takes_the_pipeline_object():
    """Checks, pieces and their loaders are functions of values (the spec, the components, configs, a call's
    arguments), so they run without a pipeline and a family from outside the package meets the same ones."""
    found = []
    for path in (PACKAGE / "pipeline").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                names = {a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)}
                if names & {"c", "pipeline", "pipe"}:
                    found.append(f"{path.name}: {node.name}")
    assert found == []


def test_pipeline_class_is_at_most_200_lines():
    """`Pipeline` holds the entry points, the spec and its views; loading, checks and preprocessing are elsewhere."""
    tree = ast.parse((PACKAGE / "pipeline" / "core.py").read_text())
    pipeline = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Pipeline")
    assert pipeline.end_lineno - pipeline.lineno + 1 <= 200


def test_no_family_name_comparison_under_cli():
    """What the command line asks of a model family is an attribute of its `Family` value (or of the command-line
    side it names, `Family.cli`), so a family from a user's module runs with `--model` as sdflax's own do: no
    comparison of a family or of a family's name under sdflax/cli/."""
    names = {'"sd"', '"sdxl"', '"sd3"', "'sd'", "'sdxl'", "'sd3'"}
    found = []
    for path in (PACKAGE / "cli").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [ast.unparse(side) for side in (node.left, *node.comparators)]
            if any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops) and any(
                    side in names or re.search(r"(^|\.)family(\.name)?$", side) for side in sides):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []


def test_the_commands_loop_over_the_command_line_features():
    """Each command-line feature (a ControlNet, an adapter, LoRAs, a guider, ...) is one module of
    sdflax/cli/features/ with its flags, checks, loading, call arguments and PNG text: the parser, the checks
    before loading, the loading, the call and the PNG text name none of its flags or their fields."""
    import argparse

    from sdflax.cli.features import FEATURES

    fields = set()
    for feature in FEATURES:
        parser = argparse.ArgumentParser()
        feature.add_flags(lambda flag, **kwargs: parser.add_argument(flag, **kwargs), "generate")
        fields |= {action.dest for action in parser._actions if action.dest != "help"}
    assert {"controlnet", "lora", "guider", "ip_adapter", "t2i_adapter", "refiner", "slg_layers"} <= fields
    found = []
    for name in ("options", "preflight", "pictures", "run", "output"):
        source = (PACKAGE / "cli" / f"{name}.py").read_text()
        words = [(f"request.{field}", f"r.{field}", f"--{field.replace('_', '-')}", f'features["{field}"]')
                 for field in sorted(fields)]
        found += [f"{name}.py: {word}" for group in words for word in group if word in source]
    assert found == []


def test_the_workers_take_the_files_slowest_first(pytestconfig):
    """pytest-xdist 3.6+ hands out the files by their number of tests unless told to keep the collection order
    (tests/conftest.py): SLOWEST_FIRST was then ignored and long files of few tests ran last, one worker alone."""
    assert getattr(pytestconfig.option, "loadscopereorder", False) is False
