"""The package's structure, checked on its syntax trees (every module, every subfolder): each module imports only
from its own layer or the layers below (LAYERS, bottom first), with no import cycle; the core never imports the
bench or the harness; a model is built in two places; every decode goes through decode_all; and the model holds no
device, precision or distributed code."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "summarizer"
# The layers, bottom first, by a module's first name under summarizer/: the one statement of the allowed order.
LAYERS = (
    ("errors", "outputs"),  # user-facing errors; atomic writes and ownership of output dirs
    ("config",),
    ("data",),
    ("model",),
    ("runtime",),
    ("decode",),
    ("evaluation",),
    ("train",),
    ("summarize", "overfit"),  # the commands beside train and eval
    ("bench", "harness", "__main__"),  # the tools and the CLI
)
TOOLS = ("bench", "harness")  # rooms the core may not import
SEARCHES = {"greedy", "beam_search", "static_search", "decode_batch"}  # only decode/search.py calls these
MODEL_BUILDERS = ("train/session.py", "model/checkpoint.py")  # the two places a Seq2Seq is built
# the model's math: no device, precision or distributed code
PURE = ("model/transformer.py", "model/attention.py", "model/dropout.py")
# Names the model may not use: any holding one of these parts, in any case (is_autocast_enabled,
# DistributedDataParallel), and "amp" as a whole name (it is part of clamp).
MODEL_FORBIDDEN_PARTS = ("cuda", "autocast", "distributed", "gradscaler")
MODEL_FORBIDDEN_WORDS = {"amp"}


def modules(root: Path) -> dict[str, ast.Module]:
    """Every module under `root` by its path relative to root's parent ('summarizer/bench/run.py')."""
    return {p.relative_to(root.parent).as_posix(): ast.parse(p.read_text(), str(p)) for p in sorted(root.rglob("*.py"))}


def imported(tree: ast.Module, path: str) -> set[str]:
    """Dotted names of every module `tree` imports, relative imports resolved, `from a import b` as a.b too."""
    package = path.rsplit("/", 1)[0].replace("/", ".")
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def is_core(path: str) -> bool:
    parts = path.split("/")
    return parts[1] not in TOOLS and parts[-1] != "__main__.py"


def layer(path: str) -> int:
    """The index in LAYERS of a module path ('summarizer/data/batches.py' -> 2); -1 for the package's root."""
    name = path.split("/")[1].removesuffix(".py")
    return next((i for i, names in enumerate(LAYERS) if name in names), -1)


def resolve(name: str, trees: dict[str, ast.Module], root: str) -> str | None:
    """The module path a dotted import names ('summarizer.data.batches.collate' -> 'summarizer/data/batches.py'),
    the longest prefix that is a module of the package; None outside it."""
    parts = name.split(".")
    if parts[0] != root:
        return None
    for end in range(len(parts), 1, -1):
        base = "/".join(parts[:end])
        for candidate in (f"{base}.py", f"{base}/__init__.py"):
            if candidate in trees:
                return candidate
    return None


def import_graph(trees: dict[str, ast.Module], root: str) -> dict[str, set[str]]:
    """Module path -> the package's modules it imports (at any depth of its code, functions included)."""
    graph = {}
    for path, tree in trees.items():
        targets = {resolve(n, trees, root) for n in imported(tree, path)}
        graph[path] = {t for t in targets if t and t != path and not t.endswith(f"{root}/__init__.py")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per import cycle found by depth-first search ('a.py -> b.py -> a.py')."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(" -> ".join(stack[stack.index(nxt):] + [node, nxt]) if nxt in stack else
                             f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, stack + [node])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def layout_violations(root: Path) -> list[str]:
    """Every way the package at `root` breaks the rules in this file's docstring, one line each."""
    trees, found = modules(root), []
    graph = import_graph(trees, root.name)
    for path, targets in sorted(graph.items()):
        found += [f"{path} imports {t}, a layer above it" for t in sorted(targets) if layer(t) > layer(path)]
        if is_core(path):
            found += [f"{path} imports {t}" for t in sorted(targets) if not is_core(t)]
    found += [f"import cycle: {c}" for c in cycles(graph)]
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
            if name == "Seq2Seq" and path not in [f"{root.name}/{m}" for m in MODEL_BUILDERS]:
                found.append(f"{path}:{node.lineno} builds Seq2Seq")
            if name in SEARCHES and path != f"{root.name}/decode/search.py" and owner != "decoding_v1":
                found.append(f"{path}:{node.lineno} calls {name} instead of decode_all")
    for pure in PURE:
        path = f"{root.name}/{pure}"
        model = trees.get(path)
        if model is None:
            found.append(f"{path} is missing")
            continue
        for node in ast.walk(model):
            word = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if word and (word in MODEL_FORBIDDEN_WORDS or any(part in word.lower() for part in MODEL_FORBIDDEN_PARTS)):
                found.append(f"{path}:{node.lineno} uses {word}")
        found += [f"{path} imports {n}" for n in imported(model, path)
                  if n.startswith(("torch.distributed", "torch.cuda", "torch.amp", "torch.nn.parallel"))]
    return found


def calls(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name
               for n in ast.walk(tree))


def test_the_package_keeps_its_layout():
    assert layout_violations(PACKAGE) == []


def test_every_decoding_command_calls_decode_all():
    trees = modules(PACKAGE)
    for path in ("evaluation/evaluate.py", "train/validation.py", "overfit.py", "summarize.py", "bench/decoding.py"):
        assert calls(trees[f"summarizer/{path}"], "decode_all"), path


def test_summarize_and_bench_reach_a_model_without_the_eval_command():
    """Loading a model to decode is decode/inference.py's: the commands that decode do not go through `eval`."""
    trees = modules(PACKAGE)
    graph = import_graph(trees, "summarizer")
    users = [p for p in graph if p == "summarizer/summarize.py" or p.startswith("summarizer/bench/")]
    assert [p for p in users if "summarizer/evaluation/evaluate.py" in graph[p]] == []
    assert all(any(t == "summarizer/decode/inference.py" for t in graph[p]) for p in
               ("summarizer/summarize.py", "summarizer/bench/decoding.py"))


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    """The checker is not vacuous: a copy of the package with one planted fault of each kind fails it."""
    root = tmp_path / "summarizer"
    for p in PACKAGE.rglob("*.py"):
        (root / p.relative_to(PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
        (root / p.relative_to(PACKAGE)).write_text(p.read_text())
    assert layout_violations(root) == []
    plant = {"train/loop.py": "from summarizer.harness import report\n",
             "data/batches.py": "import summarizer.bench.run\n",
             "runtime/placement.py": "from ..bench import memory\n",
             "data/prepared.py": "\ndef upward():\n    from summarizer.decode import constraints\n",
             "config/schema.py": "\ndef circle():\n    from summarizer.config.load import load_config\n",
             "evaluation/evaluate.py": "\ndef bypass(m, s):\n    return decoding.greedy(m, s)\n",
             "train/losses.py": "\ndef another(cfg):\n    return Seq2Seq(cfg, 10)\n",
             "model/transformer.py": "\ndef leak(x):\n    return x.cuda()\n"}
    for name, text in plant.items():
        (root / name).write_text((root / name).read_text() + text)
    found = "\n".join(layout_violations(root))
    for expected in ("train/loop.py imports summarizer/harness/report.py",
                     "data/batches.py imports summarizer/bench/run.py",
                     "runtime/placement.py imports summarizer/bench/memory.py",
                     "data/prepared.py imports summarizer/decode/constraints.py, a layer above it",
                     "evaluation/evaluate.py:", "calls greedy instead of decode_all",
                     "train/losses.py:", "builds Seq2Seq", "model/transformer.py:", "uses cuda"):
        assert expected in found, (expected, found)
    cycle = [line for line in found.splitlines() if line.startswith("import cycle: ")]
    planted = "config/schema.py -> summarizer/config/load.py -> summarizer/config/schema.py"
    assert any(planted in c for c in cycle), found


def test_every_code_path_the_docs_name_exists():
    """README.md and docs/*.md name modules by path; each must exist, so the map cannot drift from the code."""
    import re
    root = PACKAGE.parent
    named = {m for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
             for m in re.findall(r"\b((?:summarizer|data_prep|tests)/[\w/]*\.py)\b", doc.read_text())}
    assert named, "the docs name no module: the code map is missing"
    assert sorted(p for p in named if not (root / p).is_file()) == []


def test_the_readme_code_map_names_every_module():
    root = PACKAGE.parent
    readme = (root / "README.md").read_text()
    modules_ = [p.relative_to(root).as_posix() for p in sorted(PACKAGE.rglob("*.py"))
                if len(ast.parse(p.read_text()).body) > 1]  # not empty, nor a package's docstring alone
    assert [m for m in modules_ if f"`{m}`" not in readme] == []


# The test files of each module of the core (a module without a test file of its own names the ones that cover it).
TESTED_BY = {
    "errors.py": ["test_bad_input.py"],
    "outputs.py": ["test_outputs.py"],
    "config/schema.py": ["test_config.py"],
    "config/checks.py": ["test_config.py", "test_bad_input.py"],
    "config/load.py": ["test_config.py", "test_bad_input.py"],
    "config/resume.py": ["test_config.py", "test_train.py"],
    "data/tokenizer.py": ["test_tokenizer.py"],
    "data/pairs.py": ["test_evaluate.py", "test_bad_input.py"],
    "data/prepared.py": ["test_data_prep.py", "test_data.py"],
    "data/batches.py": ["test_data.py"],
    "data/subwords.py": ["test_subwords.py"],
    "data/noise.py": ["test_noise.py"],
    "model/transformer.py": ["test_model.py"],
    "model/attention.py": ["test_model.py"],
    "model/dropout.py": ["test_dropout.py"],
    "model/checkpoint.py": ["test_checkpoint.py"],
    "runtime/device.py": ["test_runtime.py"],
    "runtime/distributed.py": ["test_distributed.py"],
    "runtime/placement.py": ["test_runtime.py", "test_distributed.py"],
    "decode/search.py": ["test_decoding.py"],
    "decode/constraints.py": ["test_decoding.py"],
    "decode/rules.py": ["test_decoding.py"],
    "decode/static.py": ["test_static_decoding.py"],
    "decode/lexicon.py": ["test_decoding.py"],
    "decode/quantize.py": ["test_decoding.py", "test_evaluate.py"],
    "decode/readable.py": ["test_readable.py"],
    "decode/inference.py": ["test_evaluate.py", "test_scoring.py", "test_readable.py"],
    "evaluation/scoring.py": ["test_scoring.py"],
    "evaluation/evaluate.py": ["test_evaluate.py"],
    "train/loop.py": ["test_train.py"],
    "train/session.py": ["test_train.py"],
    "train/validation.py": ["test_train.py"],
    "train/losses.py": ["test_losses_optim.py"],
    "train/optim.py": ["test_losses_optim.py"],
    "train/watch/monitor.py": ["test_train.py", "test_module_stats.py"],
    "train/watch/flops.py": ["test_flops.py"],
    "train/watch/module_stats.py": ["test_module_stats.py"],
    "train/watch/nonfinite.py": ["test_train.py"],
    "train/watch/spikes.py": ["test_spikes.py"],
    "summarize.py": ["test_summarize.py"],
    "overfit.py": ["test_train.py"],
}


def test_every_module_of_the_core_names_the_tests_that_cover_it():
    """tests/ mirrors the package: each core module has its test file, or TESTED_BY names the ones covering it."""
    core = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
                  if is_core(p.relative_to(PACKAGE.parent).as_posix()) and p.name != "__init__.py")
    tests = PACKAGE.parent / "tests"
    for module in core:
        named = TESTED_BY.get(module, [f"test_{Path(module).stem}.py"])
        assert named and all((tests / t).is_file() for t in named), (module, named)
    assert sorted(set(TESTED_BY) - set(core)) == []  # no entry for a module that is gone
