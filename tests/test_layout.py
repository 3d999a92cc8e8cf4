"""The package's structure, checked on its syntax trees (every module, every subfolder): the core never imports
the bench or the harness, a model is built in two places, every decode goes through decode_all, and the model
holds no device, precision or distributed code."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "summarizer"
TOOLS = ("bench", "harness")  # rooms the core may not import
SEARCHES = {"greedy", "beam_search", "decode_batch"}  # search loops: only decoding.py runs its own
# Names model.py may not use: any holding one of these parts, in any case (is_autocast_enabled,
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


def layout_violations(root: Path) -> list[str]:
    """Every way the package at `root` breaks the rules in this file's docstring, one line each."""
    trees, found = modules(root), []
    tools = tuple(f"{root.name}.{t}" for t in TOOLS)
    for path, tree in trees.items():
        if is_core(path):
            found += [f"{path} imports {n}" for n in sorted(imported(tree, path)) if n.startswith(tools)
                      and n.split(".")[1] in TOOLS]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            owner = func.value.id if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) else ""
            if name == "Seq2Seq" and path not in (f"{root.name}/session.py", f"{root.name}/checkpoint.py"):
                found.append(f"{path}:{node.lineno} builds Seq2Seq")
            if name in SEARCHES and path != f"{root.name}/decoding.py" and owner != "decoding_v1":
                found.append(f"{path}:{node.lineno} calls {name} instead of decode_all")
    model = trees.get(f"{root.name}/model.py")
    if model is not None:
        for node in ast.walk(model):
            word = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if word and (word in MODEL_FORBIDDEN_WORDS or any(part in word.lower() for part in MODEL_FORBIDDEN_PARTS)):
                found.append(f"{root.name}/model.py:{node.lineno} uses {word}")
        found += [f"{root.name}/model.py imports {n}" for n in imported(model, f"{root.name}/model.py")
                  if n.startswith(("torch.distributed", "torch.cuda", "torch.amp", "torch.nn.parallel"))]
    return found


def calls(tree: ast.Module, name: str) -> bool:
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name
               for n in ast.walk(tree))


def test_the_package_keeps_its_layout():
    assert layout_violations(PACKAGE) == []


def test_every_decoding_command_calls_decode_all():
    trees = modules(PACKAGE)
    for path in ("evaluate.py", "validation.py", "overfit.py", "summarize.py", "bench/run.py", "bench/decoding.py"):
        assert calls(trees[f"summarizer/{path}"], "decode_all"), path


def test_the_checker_finds_each_kind_of_violation(tmp_path):
    """The checker is not vacuous: a copy of the package with one planted fault of each kind fails it."""
    root = tmp_path / "summarizer"
    for p in PACKAGE.rglob("*.py"):
        (root / p.relative_to(PACKAGE)).parent.mkdir(parents=True, exist_ok=True)
        (root / p.relative_to(PACKAGE)).write_text(p.read_text())
    assert layout_violations(root) == []
    plant = {"train.py": "from summarizer.harness import report\n",
             "data.py": "import summarizer.bench.run\n",
             "placement.py": "from .bench import memory\n",
             "evaluate.py": "\ndef bypass(m, s):\n    return decoding.greedy(m, s)\n",
             "losses.py": "\ndef another(cfg):\n    return Seq2Seq(cfg, 10)\n",
             "model.py": "\ndef leak(x):\n    return x.cuda()\n"}
    for name, text in plant.items():
        (root / name).write_text((root / name).read_text() + text)
    found = "\n".join(layout_violations(root))
    for expected in ("train.py imports summarizer.harness", "data.py imports summarizer.bench",
                     "placement.py imports summarizer.bench", "evaluate.py:", "calls greedy instead of decode_all",
                     "losses.py:", "builds Seq2Seq", "model.py:", "uses cuda"):
        assert expected in found, (expected, found)


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
    modules_ = [p.relative_to(root).as_posix() for p in sorted(PACKAGE.rglob("*.py")) if p.stat().st_size]  # not empty
    assert [m for m in modules_ if f"`{m}`" not in readme] == []
