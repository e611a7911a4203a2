"""The import graph (read with ast, every import at any depth) has no cycles and its arrows point one way;
functions stay short."""

from __future__ import annotations

import ast
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "contract", "producer", "worker", "cli")
# (importer package, imported package) pairs that must never occur.
FORBIDDEN = {
    *((low, high) for low in ("engine", "kernels") for high in ("contract", "producer", "worker", "cli")),
    ("kernels", "engine"),
    ("producer", "worker"),
    ("worker", "producer"),
    *(("contract", other) for other in ("engine", "kernels", "producer", "worker", "cli")),
    *((other, "cli") for other in ("engine", "kernels", "contract", "producer", "worker")),
}


def module_files() -> dict[str, Path]:
    """Dotted module name → file, for every module of the packages."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(["sluice", *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    return modules


def imported_names(module: str, path: Path) -> Iterator[str]:
    """Every dotted name an import statement anywhere in the file asks for (relative ones resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            yield from (f"{base}.{alias.name}" for alias in node.names)


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name lives in (`pkg.mod.func` → `pkg.mod`), None outside the packages."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """Module → the modules it imports (module-level and function-level alike)."""
    modules = module_files()
    graph = {}
    for module, path in modules.items():
        targets = {resolve(name, modules) for name in imported_names(module, path)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def top(module: str) -> str:
    """The design folder a `sluice.<folder>...` module lives in."""
    return module.split(".")[1]


def test_graph_is_read():
    graph = import_graph()
    names = {"sluice.engine.engine", "sluice.contract.batch", "sluice.producer.client",
             "sluice.worker.worker", "sluice.cli.main"}
    assert names <= set(graph)
    assert "sluice.contract.batch" in graph["sluice.worker.worker"]
    assert "sluice.producer.client" in graph["sluice.cli.batch_commands"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_top_level_packages_form_no_cycle():
    graph = import_graph()
    packages: dict[str, set[str]] = {top(m): set() for m in graph}
    for source, targets in graph.items():
        packages[top(source)] |= {top(t) for t in targets} - {top(source)}
    assert cycles(packages) == []


def test_imports_point_one_way():
    graph = import_graph()
    wrong = sorted(
        f"{source} -> {target}"
        for source, targets in graph.items()
        for target in targets
        if (top(source), top(target)) in FORBIDDEN
    )
    assert wrong == []


def test_no_module_imports_a_bare_folder_name():
    """Every import of our own code goes through `sluice.`: the bare folder names are not importable once
    installed."""
    bare = sorted(
        f"{module}: {name}"
        for module, path in module_files().items()
        for name in imported_names(module, path)
        if name.split(".")[0] in PACKAGES
    )
    assert bare == []


def test_tests_and_benchmarks_import_no_bare_folder_name_even_in_child_code():
    """Tests and benchmarks, including the code strings they hand to child processes, import our code as
    `sluice.` (a bare `kernels` would be Hugging Face's distribution, and the other bare names nothing)."""
    pattern = re.compile(rf"(?:^\s*|[\"';] *)(?:from|import) ({'|'.join(PACKAGES)})\b", re.M)
    found = [
        f"{path.relative_to(ROOT)}: {match.group(0).strip()}"
        for folder in ("tests", "bench", "examples")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for match in pattern.finditer(path.read_text())
    ]
    assert found == []


# pytest's own file name, one per test folder by design.
SHARED_BASENAMES = {"__init__.py", "conftest.py"}


def shared_basenames(paths: list[Path]) -> dict[str, list[str]]:
    """Basename → the files that carry it, for every basename held by more than one file (bar
    SHARED_BASENAMES)."""
    holders: dict[str, list[str]] = {}
    for path in paths:
        if path.name not in SHARED_BASENAMES:
            holders.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    return {name: files for name, files in holders.items() if len(files) > 1}


def test_no_two_files_share_a_name():
    """One file name per concept: `shards.py` in two folders reads as one module in a traceback or a grep."""
    folders = (*PACKAGES, "bench", "tests", "examples", "models", "sluice")
    paths = sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))
    assert len(paths) > 100
    sample = [ROOT / "a/x.py", ROOT / "b/x.py", ROOT / "c/conftest.py", ROOT / "d/conftest.py"]
    assert shared_basenames(sample) == {"x.py": ["a/x.py", "b/x.py"]}
    assert shared_basenames(paths) == {}


def engine_reaches(source: str) -> list[str]:
    """Every `<x>.engine` attribute read in source: a reach past `LLM`'s public surface into the engine."""
    return [ast.unparse(node) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Attribute)
            and node.attr == "engine"]  # fmt: skip


def test_the_worker_drives_the_engine_only_through_llm():
    """worker/ calls LLM.add_request/step/abort/has_unfinished/num_unfinished, never `llm.engine.*`."""
    sample = "llm.engine.step()\nself.llm.engine.abort(r)\nllm.step()"
    assert engine_reaches(sample) == ["llm.engine", "self.llm.engine"]
    files = sorted((ROOT / "worker").rglob("*.py"))
    found = {str(p.relative_to(ROOT)): engine_reaches(p.read_text()) for p in files}
    assert len(found) > 10
    assert {path: reaches for path, reaches in found.items() if reaches} == {}
    from sluice.engine import LLM

    surface = ("add_request", "step", "abort", "has_unfinished", "num_unfinished", "stats", "max_num_seqs")
    assert all(getattr(LLM, name).__doc__ for name in surface)


# Where Settings may be read (`get_settings()`): process and job entry points, which pass them down, and the
# fallbacks of objects a library user or a test builds without handing any.
SETTINGS_READERS = {
    ("producer/client.py", "__init__"),
    ("producer/cron.py", "tick_job"),  # rq job entry points (a stock rq worker calls them by name)
    ("producer/cron.py", "add_command"),  # CLI commands
    ("worker/finalize.py", "finalize_batch"),
    ("worker/shard_run.py", "run_shard"),
    ("producer/demo.py", "main"),
    ("producer/server/app.py", "create_app"),
    ("worker/cli.py", "start"),
    ("worker/reaper.py", "run_command"),
    ("worker/webhooks.py", "run_command"),
    ("worker/worker.py", "__init__"),
    ("cli/server.py", "key_store"),
    ("cli/server.py", "serve"),
    ("cli/server.py", "webhook"),
}


def environment_reads(path: Path) -> Iterator[tuple[str, str]]:
    """(function, what) for each `get_settings()` call and each os.environ / os.getenv use in the file."""
    for function in ast.walk(ast.parse(path.read_text())):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "get_settings":
                yield function.name, "get_settings()"
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv"):
                yield function.name, f"os.{node.attr}"


# The only files that read the environment: Settings, and below the contract the kernels' options.
ENVIRONMENT_READERS = {"contract/settings.py", "kernels/options.py"}


def test_settings_are_read_at_entry_points_and_the_environment_only_by_settings():
    found = {
        (str(path.relative_to(ROOT)), function, what)
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if str(path.relative_to(ROOT)) not in ENVIRONMENT_READERS
        for function, what in environment_reads(path)
    }
    assert ("worker/cli.py", "start", "get_settings()") in found
    assert "environ" in {n.attr for n in ast.walk(ast.parse((ROOT / "kernels/options.py").read_text()))
                                     if isinstance(n, ast.Attribute)}  # fmt: skip
    assert {(f, fn) for f, fn, what in found if what == "get_settings()"} <= SETTINGS_READERS
    assert {(f, fn, what) for f, fn, what in found if what != "get_settings()"} == set()


MAX_FUNCTION_LINES = 40


def long_functions(source: str, filename: str = "<source>") -> list[str]:
    """'file:line name (n lines)' for every function, nested ones too, longer than MAX_FUNCTION_LINES, counted
    from its `def` line to its last line (docstring included, decorators not)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{filename}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_the_function_length_count_sees_long_and_nested_functions():
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    assert long_functions(f"@decorator\ndef fits():\n{body}") == []
    assert long_functions(f"def long():\n{body}    return 0\n") == ["<source>:1 long "
                                                                    f"({MAX_FUNCTION_LINES + 1} lines)"]
    nested = "class C:\n    async def outer(self):\n        def inner():\n" + body.replace(
        "    ", "            ")
    assert [f.split()[1] for f in long_functions(nested + "            return 0\n")] == ["outer", "inner"]


def test_functions_are_at_most_40_lines():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True,
                             check=True)
    paths = [ROOT / name for name in tracked.stdout.split()]
    assert len(paths) > 100, "git ls-files lists the tracked Python files"
    offenders = [f for path in paths if path.is_file()
                 for f in long_functions(path.read_text(), str(path.relative_to(ROOT)))]
    assert not offenders, f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(offenders)


def private_names(source: str) -> set[str]:
    """The `_name`s (dunders aside) a source defines or reaches as attributes."""
    found = {node.attr if isinstance(node, ast.Attribute) else node.name
             for node in ast.walk(ast.parse(source))
             if isinstance(node, ast.Attribute | ast.FunctionDef | ast.AsyncFunctionDef)}  # fmt: skip
    return {name for name in found if name.startswith("_") and not name.startswith("__")}


def rq_bases(tree: ast.Module) -> dict[str, str]:
    """Name → 'rq.module:Class' for every class the file imports from rq."""
    return {alias.asname or alias.name: f"{node.module}:{alias.name}" for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "rq"
            for alias in node.names}


def rq_class_privates(target: str) -> set[str]:
    """The private names of an rq class and its rq ancestors (from their sources)."""
    import importlib
    import inspect

    module, _, name = target.partition(":")
    found = getattr(importlib.import_module(module), name, None)
    if not isinstance(found, type):
        return set()
    ancestors = [c for c in found.__mro__ if c.__module__.split(".")[0] == "rq"]
    return set().union(*(private_names(inspect.getsource(c)) for c in ancestors))


def rq_reaches(sources: dict[str, str], steps: tuple[str, ...]) -> list[str]:
    """'file:line what' wherever a source reaches an rq step of the adapter's, a private rq name on an object
    that is not its own (`job._x`, `getattr(w, "_x")`), or, in a class built on an rq class, one of that
    class's private names through `self` (or a `def` of one: an override)."""
    import rq

    everywhere = set().union(*(private_names(p.read_text()) for p in Path(rq.__file__).parent.rglob("*.py")))
    trees = {file: ast.parse(source) for file, source in sources.items()}
    classes: dict[str, set[str]] = {}  # class name → private names of its rq ancestry
    for _ in range(3):  # our subclasses of our subclasses of rq's classes
        for tree in trees.values():
            imported = rq_bases(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    names = [getattr(b, "id", None) for b in node.bases]
                    inherited = [rq_class_privates(imported[n]) if n in imported else classes.get(n)
                                 for n in names]
                    if any(i is not None for i in inherited):
                        classes[node.name] = set().union(*(i for i in inherited if i is not None))
    return [f"{file}:{line} {what}" for file, tree in trees.items()
            for line, what in _rq_reaches_in(tree, classes, everywhere, steps)]  # fmt: skip


def _rq_reaches_in(tree: ast.Module, classes: dict[str, set[str]], everywhere: set[str],
                   steps: tuple[str, ...]) -> Iterator[tuple[int, str]]:
    for klass in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name in classes]:
        for node in ast.walk(klass):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                name = node.name
                if name in steps:  # an override of a step only the adapter may call
                    yield node.lineno, f"{klass.name}: def {name}"
            else:
                name = (node.attr if isinstance(node, ast.Attribute)
                        and getattr(node.value, "id", "") == "self" else "")
            if name in classes[klass.name]:
                yield node.lineno, f"{klass.name}: {name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (node.attr in steps or node.attr in everywhere
                                                and getattr(node.value, "id", None) not in ("self", "cls")):
            yield node.lineno, ast.unparse(node)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "setattr", "hasattr"):
            named = [a.value for a in node.args[1:2] if isinstance(a, ast.Constant)]
            if named and (named[0] in steps or named[0] in everywhere):
                yield node.lineno, ast.unparse(node)


def test_the_rq_reach_check_sees_private_names_steps_and_overrides():
    sample = {
        "a.py": "from rq import SimpleWorker\nclass W(SimpleWorker):\n    def "
                "_install_signal_handlers(self): pass\n    def go(self, job):\n        self._own = 1\n       "
                " self._stop_requested = True\n        self.perform_job(job)\n        job._status\n        "
                "getattr(job, '_data')\n    def perform_job(self, job): pass\n",
        "b.py": "from a import W\nclass V(W):\n    def run(self):\n        return self._finalize_success\n",
        "c.py": "class Plain:\n    def _stop_requested(self): return self._data\n",
    }
    found = [f.split(" ", 1)[1] for f in rq_reaches(sample, ("perform_job",))]
    assert sorted(found) == sorted(["W: _install_signal_handlers", "W: _stop_requested", "self.perform_job",
                                    "job._status", "getattr(job, '_data')", "V: _finalize_success",
                                    "W: def perform_job"])


def test_only_the_adapter_reaches_rq_internals():
    """Outside contract/rq_adapter.py no module reaches rq's private names or the worker steps the adapter
    wraps (rq_adapter.STEPS)."""
    from sluice.contract.rq_adapter import STEPS

    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in files if p.name != "rq_adapter.py"}
    assert "worker/rq_jobs.py" in sources and len(sources) > 100
    assert rq_reaches(sources, STEPS) == []
    adapter = (ROOT / "contract" / "rq_adapter.py").read_text()
    assert len(rq_reaches({"contract/rq_adapter.py": adapter}, STEPS)) >= len(STEPS)


S3_OPENERS = ("open_storage", "open_output", "split_url", "read_url", "url_lines", "S3Storage", "s3_client")


def calls_without_s3_style(source: str) -> list[str]:
    """Calls of the storage openers that pass no S3 addressing style (`s3_style=`, or every positional
    one)."""
    import inspect

    from sluice.contract import storage

    found = []
    for node in ast.walk(ast.parse(source)):
        name = getattr(node, "func",
                       None) and (getattr(node.func, "id", None) or getattr(node.func, "attr", None))
        if name in S3_OPENERS:
            position = list(inspect.signature(getattr(storage, name)).parameters).index("s3_style")
            if len(node.args) <= position and "s3_style" not in [k.arg for k in node.keywords]:
                found.append(f"{node.lineno} {ast.unparse(node)}")
    return found


def test_every_storage_opened_outside_the_contract_gets_the_s3_style_from_settings():
    """The S3 addressing style is Settings' (SLUICE_S3_ADDRESSING_STYLE), passed down: every call that opens a
    storage outside contract/storage.py names one."""
    sample = "open_storage(url)\nsplit_url(u, s3_style=s)\nread_url(u, None, s)\nS3Storage(b, 'p')\nfoo(u)\n"
    assert [f.split(" ", 1)[1] for f in calls_without_s3_style(sample)] == ["open_storage(url)",
                                                                            "S3Storage(b, 'p')"]
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))
             if p.name != "storage.py"]
    found = {str(p.relative_to(ROOT)): calls_without_s3_style(p.read_text()) for p in files}
    assert sum(map(len, found.values())) == 0, {k: v for k, v in found.items() if v}
    assert len(files) > 100


PATCHED_LIBRARIES = ("torch", "bitsandbytes")
# The monkeypatches left (issue 30: none). The two that deferred bitsandbytes' torch.compile and dynamo
# imports went with bitsandbytes' import on CPU: LLM.int8() runs our kernels there
# (engine/quantization/int8_cpu.py); where bitsandbytes still serves, it is a plain import.
KNOWN_PATCHES: set[tuple[str, str]] = set()


def library_names(tree: ast.Module) -> set[str]:
    """Names bound to torch or bitsandbytes, or to anything imported from them (modules, classes,
    functions)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names
                      if a.name.split(".")[0] in PATCHED_LIBRARIES}  # fmt: skip
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PATCHED_LIBRARIES:
            names |= {a.asname or a.name for a in node.names}
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and "bnb" in getattr(node.value.func, "id", "")):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def library_patches(source: str) -> list[str]:
    """Every attribute a source sets on torch or bitsandbytes (`torch.x = ...`, `nn.Linear.x += ...`,
    `setattr(torch..., ...)`, `del torch.x`) and every `sys.modules[...]` entry it sets for them."""
    tree = ast.parse(source)
    names = library_names(tree)

    def owned(node: ast.expr) -> bool:
        while isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        return isinstance(node, ast.Name) and node.id in names

    found = []
    for node in ast.walk(tree):
        kinds = {ast.Assign: lambda n: n.targets, ast.AugAssign: lambda n: [n.target],
                 ast.AnnAssign: lambda n: [n.target], ast.Delete: lambda n: n.targets}
        targets = kinds.get(type(node), lambda n: [])(node)
        found += [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and owned(t.value)]
        found += [ast.unparse(t) for t in targets if isinstance(t, ast.Subscript)
                  and ast.unparse(t.value) == "sys.modules"
                  and any(lib in ast.unparse(t.slice) for lib in PATCHED_LIBRARIES)]  # fmt: skip
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr",
                                                                             "delattr") and node.args:
            found += [ast.unparse(node)] if owned(node.args[0]) else []
    return found


def test_the_patch_check_sees_every_way_of_patching_a_library():
    sample = ("import torch\nimport torch.nn as tnn\nfrom torch import nn\nimport bitsandbytes as bnb\n"
              "import sys\ntorch.compile = f\ntnn.functional.relu = g\nnn.Linear.forward += h\n"
              "setattr(torch, 'x', 1)\nbnb.nn.Linear4bit.forward = k\ndel torch.x\n"
              "sys.modules['torch._dynamo'] = None\nb = _bnb()\nb.functional.q: int = 1\nmod.weight = w\n"
              "state.dtype = torch.float16\nsetattr(mod, 'x', torch)\n")
    assert library_patches(sample) == [
        "torch.compile", "tnn.functional.relu", "nn.Linear.forward", "bnb.nn.Linear4bit.forward", "torch.x",
        "sys.modules['torch._dynamo']", "b.functional.q", "setattr(torch, 'x', 1)"]  # fmt: skip


def test_no_module_patches_a_library_beyond_the_known_patches():
    """No module (engine/ and kernels/ above all) assigns attributes on torch or bitsandbytes (or their
    classes), save the patches listed in KNOWN_PATCHES, which may only shrink."""
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    found = {(str(p.relative_to(ROOT)), patch) for p in files for patch in library_patches(p.read_text())}
    assert len(files) > 100
    assert found == KNOWN_PATCHES


def test_models_are_built_without_their_random_init_and_without_patching_torch():
    """build_model skips nn.init through a TorchFunctionMode: no random number is drawn (the generator's state
    is unchanged), nn.init's functions stay torch's own, and outside the mode they initialise again."""
    import torch

    from sluice.engine.models.llama import ModelConfig
    from sluice.engine.models.loader import build_model, read_config, skip_init

    before = {name: getattr(torch.nn.init, name) for name in dir(torch.nn.init)}
    state = torch.random.get_rng_state()
    model = build_model(ModelConfig.from_hf(read_config(str(ROOT / "models" / "sluice-tiny"))))
    assert torch.equal(torch.random.get_rng_state(),
                       state) and sum(p.numel() for p in model.parameters()) > 10**6
    with skip_init():
        weight = torch.full((4, 4), 7.0)
        torch.nn.init.kaiming_uniform_(weight, a=5**0.5)
        torch.nn.init.normal_(tensor=weight)
        head = torch.nn.Linear(64, 64)
    assert torch.equal(weight, torch.full((4, 4), 7.0)) and torch.equal(torch.random.get_rng_state(), state)
    assert {name: getattr(torch.nn.init, name) for name in dir(torch.nn.init)} == before
    torch.nn.init.normal_(weight)
    assert not torch.equal(weight, torch.full((4, 4), 7.0)) and head.weight.shape == (64, 64)


ENGINE_MAX_LINES = 250


def test_the_engine_keeps_the_step_outline_in_at_most_250_lines():
    """engine/engine.py holds add_request / step / abort / has_unfinished and the step's outline; output
    processing (with speculative verification), request validation and memory housekeeping live in modules of
    their own."""
    source = (ROOT / "engine" / "engine.py").read_text()
    assert len(source.splitlines()) <= ENGINE_MAX_LINES
    engine = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    methods = {n.name for n in engine.body if isinstance(n, ast.FunctionDef)}
    assert {"add_request", "step", "abort", "has_unfinished"} <= methods
    assert not methods & {"append_tokens", "_stop_reason", "_verify", "_pool", "_validate", "_output"}
    imported = import_graph()["sluice.engine.engine"]
    assert {f"sluice.engine.{m}" for m in ("output_processor", "request_intake", "housekeeping")} <= imported


def method_assignments(source: str) -> list[str]:
    """Every assignment of a function over an attribute of another object (`llm.step = measured`, `mod.forward
    = f.__get__(mod)`, `x.y = MethodType(f, x)`, `setattr(o, "m", lambda: ...)`); `self`/`cls` aside."""
    tree = ast.parse(source)
    functions = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}

    def is_function(value: ast.expr) -> bool:
        if isinstance(value, ast.Lambda) or isinstance(value, ast.Name) and value.id in functions:
            return True
        name = ast.unparse(value.func) if isinstance(value, ast.Call) else ""
        return name.endswith(("MethodType", "__get__", "partial", "wraps"))

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else []
        found += [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and is_function(node.value)
                  and not (isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"))]  # fmt: skip
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) == 3:
            found += [ast.unparse(node)] if is_function(node.args[2]) else []
    return found


def test_the_method_assignment_check_sees_every_way_of_replacing_a_method():
    sample = ("def wrapper(): pass\nllm.step = wrapper\nmod.forward = f.__get__(mod)\n"
              "slot.forward = MethodType(f, s)\nsetattr(o, 'm', lambda: 1)\nself.step = wrapper\n"
              "mod.weight = w\nx.callback = functools.partial(g)\n")
    assert method_assignments(sample) == ["llm.step", "mod.forward", "slot.forward", "x.callback",
                                          "setattr(o, 'm', lambda: 1)"]


def test_no_module_assigns_over_another_objects_method():
    """No side channels: the worker observes steps through LLM.add_step_observer, models get our forwards as
    classes of their own (engine.models.generic.with_forward); nothing replaces a method of an object it does
    not own."""
    files = [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]
    found = {str(p.relative_to(ROOT)): method_assignments(p.read_text()) for p in files}
    assert len(files) > 100
    assert {path: names for path, names in found.items() if names} == {}


def private_reaches(module: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """'line what' for each `_name` of another of our modules a file imports (`from m import _x`) or reads
    through a module or name it imported (`m._x`, `Class._x`)."""
    tree, found = ast.parse(path.read_text(), str(path)), []
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sluice"):
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and resolve(f"{node.module}.{alias.name}", modules) != module:
                    found.append(f"{node.lineno} from {node.module} import {alias.name}")
                bound.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("sluice")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"{node.lineno} {ast.unparse(node)}")
    return found


def test_the_private_reach_check_sees_imports_and_module_attributes(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from sluice.kernels import int8_weights\n"
                    "from sluice.kernels.linear import _gemv, linear\n"
                    "int8_weights._fused()\nint8_weights.int8_linear\nobj._own\nlinear._x\n")
    assert sorted(private_reaches("sluice.m", path, module_files())) == [
        "2 from sluice.kernels.linear import _gemv", "3 int8_weights._fused", "6 linear._x"]


def test_no_module_reaches_another_modules_private_names():
    """Across engine/, kernels/, contract/, producer/, worker/ and cli/, a `_name` is its own module's:
    nothing imports one from another module or calls one through an imported module."""
    modules = module_files()
    found = {module: private_reaches(module, path, modules) for module, path in modules.items()}
    assert len(found) > 100
    assert {module: reaches for module, reaches in found.items() if reaches} == {}


def test_the_model_owns_its_fused_layout():
    """FUSED (each fused projection and the checkpoint linears it concatenates) is defined once, by the model
    package (engine/models/fused_layout.py, torch-free for the worker's read-ahead); the memory modules import
    it."""
    from sluice.engine import weight_reserve
    from sluice.engine.models import LlamaModel, fused_layout

    defined = sorted(
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "engine").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "FUSED" for t in node.targets)
        and isinstance(node.value, ast.Dict)
    )
    assert defined == ["engine/models/fused_layout.py"]
    assert LlamaModel.FUSED is fused_layout.FUSED is weight_reserve.FUSED
    assert "self_attn.qkv_proj" in LlamaModel.FUSED


def test_the_weight_reservation_is_handed_to_llm_and_kernel_options_to_the_engine():
    """No second door into the engine: engine.weight_reserve keeps no reservation of its own (no `global`),
    the loader takes the one LLM(weight_reservation=...) is handed; kernels.options has no process-wide setter
    for the engine (`configure`) and no change callbacks (`on_change`)."""
    import inspect

    from sluice.engine import LLM
    from sluice.kernels import options

    reserve = ast.parse((ROOT / "engine" / "weight_reserve.py").read_text())
    assert not [n for n in ast.walk(reserve) if isinstance(n, ast.Global)]
    assert "weight_reservation" in inspect.signature(LLM.__init__).parameters
    assert not hasattr(options, "configure") and not hasattr(options, "on_change")
    trees = [ast.parse(p.read_text()) for p in (ROOT / "engine").rglob("*.py")]
    calls = {ast.unparse(n.func) for tree in trees for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert "options.active" in calls and not {"options.use", "options.reset"} & calls


# One concept kept in two places on purpose, under one name: the engine decodes data: URLs itself and the
# contract fetches and decodes every image URL, and neither may import the other (FORBIDDEN).
MIRRORED = {name: {"sluice.contract.images", "sluice.engine.multimodal.image_decode"}
            for name in ("ImageError", "decode_image", "image_hash")}


def top_level_defs(path: Path) -> dict[str, str]:
    """Public name → "class" or "function" for every class and function a module defines at its top level."""
    kinds = {ast.ClassDef: "class", ast.FunctionDef: "function", ast.AsyncFunctionDef: "function"}
    return {node.name: kinds[type(node)] for node in ast.parse(path.read_text()).body
            if type(node) in kinds and not node.name.startswith("_")}  # fmt: skip


def names_imported_by_name(paths: list[Path]) -> set[tuple[str, str]]:
    """(module, name) of every `from sluice.<module> import <name>` in the files, `as` or not."""
    return {(node.module, alias.name) for path in paths for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sluice.")
            for alias in node.names}  # fmt: skip


def shared_names(defs: dict[str, dict[str, str]], imported: set[tuple[str, str]]) -> dict[str, list[str]]:
    """Name → its defining modules, for every public class defined in more than one module and every function
    imported by name (a call site that does not say its module) while another module defines the same name."""
    holders: dict[str, list[str]] = {}
    for module, names in sorted(defs.items()):
        for name in names:
            holders.setdefault(name, []).append(module)
    return {name: modules for name, modules in holders.items() if len(modules) > 1
            and set(modules) != MIRRORED.get(name)
            and any(defs[m][name] == "class" or (m, name) in imported for m in modules)}  # fmt: skip


def test_the_shared_name_check_sees_classes_and_functions_imported_by_name(tmp_path):
    for name, source in {"a": "class Request: ...\ndef status(): ...\ndef plan(): ...\ndef _own(): ...\n",
                         "b": "class Request: ...\ndef status(): ...\ndef plan(): ...\ndef _own(): ...\n",
                         "c": "from sluice.a import status\nimport sluice.b\nsluice.b.plan()\n"}.items():
        (tmp_path / f"{name}.py").write_text(source)
    defs = {f"sluice.{n}": top_level_defs(tmp_path / f"{n}.py") for n in "abc"}
    imported = names_imported_by_name(sorted(tmp_path.glob("*.py")))
    assert imported == {("sluice.a", "status")}
    both = ["sluice.a", "sluice.b"]
    assert shared_names(defs, imported) == {"Request": both, "status": both}


def test_one_name_means_one_thing_across_the_packages():
    """A public class is defined in one module of the packages, and so is a function that anything (packages,
    tests, benchmarks) imports by name; functions always called through their module (`nf4.dequantize`,
    `int4_weights.dequantize`) read with it. MIRRORED names the one concept kept in two places."""
    modules = module_files()
    defs = {module: top_level_defs(path) for module, path in modules.items()}
    users = [*modules.values(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]
    imported = names_imported_by_name(users)
    assert len(imported) > 300
    for name, mirrors in MIRRORED.items():
        assert {module for module, names in defs.items() if name in names} == mirrors
    assert shared_names(defs, imported) == {}
