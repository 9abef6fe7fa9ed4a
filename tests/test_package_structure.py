"""The package's shape: no import cycles between its modules, and the paths that must stay
quick (``mlx-dspark --help``, ``convert``, the CLI's shared helpers) never load MLX."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# pyproject.toml's package-dir: the converter and the kernels live beside the package
PACKAGES = {"mlx_dspark": ROOT / "mlx_dspark", "mlx_dspark.converter": ROOT / "converter",
            "mlx_dspark.kernels": ROOT / "kernels"}


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg, folder in PACKAGES.items():
        for f in folder.rglob("*.py"):
            if pkg == "mlx_dspark" and f.relative_to(folder).parts[0] in ("converter", "kernels"):
                continue
            name = ".".join([pkg, *f.relative_to(folder).with_suffix("").parts])
            mods[name.removesuffix(".__init__")] = f
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> package modules it imports, at the top or inside functions (a lazy import
    is still a dependency). Importing ``a.b.c`` counts as depending on ``a.b.c`` only."""
    mods = _modules()
    graph = {}
    for name, f in mods.items():
        package = name if f.stem == "__init__" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[:len(up) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None."""
    state = {}                       # 1: on the current path, 2: done

    def visit(n, path):
        state[n] = 1
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d, path + [d])
                if found:
                    return found
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n, [n])
            if found:
                return found
    return None


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert {"mlx_dspark.api", "mlx_dspark.converter.layout", "mlx_dspark.kernels.mamba"} <= set(graph)
    assert "mlx_dspark.models.weights" in graph["mlx_dspark.models.nemotron_h"]      # lazy or not, edges count
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_training_scripts_import_no_cycle():
    # training/ runs as flat scripts (``python training/x.py``): a module imports another by
    # its bare name, at the top or inside a function (lazy or not, edges count)
    mods = {f.stem: f for f in (ROOT / "training").glob("*.py")}
    graph = {}
    for name, f in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                deps.add(node.module.split(".")[0])
        graph[name] = {d for d in deps if d in mods and d != name}
    assert {"data", "drafter_model"} <= graph["train_drafter"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def _loads_mlx(code: str, cwd) -> bool:
    probe = code + "\nimport sys\nprint('MLX' if any(m == 'mlx' or m.startswith('mlx.') for m in sys.modules) else 'NO')"
    r = subprocess.run([sys.executable, "-c", probe], cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().splitlines()[-1] == "MLX"


def test_help_convert_verify_and_the_cli_helpers_do_not_load_mlx(tmp_path):
    assert not _loads_mlx("import mlx_dspark.cli.common, mlx_dspark.converter.layout", tmp_path)
    assert not _loads_mlx("from mlx_dspark import cli\n"
                          "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass", tmp_path)
    assert not _loads_mlx(
        "from mlx_dspark import cli\nfrom testkit.synthetic import synth_target\n"
        "synth_target('src')\n"
        "assert cli.main(['convert', 'src', '-o', 'out', '--no-progress']) in (0, None)", tmp_path)
    assert (tmp_path / "out" / "model.safetensors").is_file()
    assert not _loads_mlx("from mlx_dspark import cli\nassert cli.main(['verify', 'out']) == 0",
                          tmp_path)
    # and the probe does see MLX when it is loaded
    assert _loads_mlx("import mlx_dspark.decode.loop", tmp_path)


def test_nothing_outside_tests_imports_from_tests():
    helpers = {f.stem for f in (ROOT / "tests").rglob("*.py")}
    for folder in ("mlx_dspark", "converter", "kernels", "benchmarks", "training"):
        for f in (ROOT / folder).rglob("*.py"):
            text = f.read_text()
            assert "tests" not in "".join(line for line in text.splitlines()
                                          if "sys.path" in line), f"{f}: puts tests/ on sys.path"
            for node in ast.walk(ast.parse(text, str(f))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and not node.level
                         else [])
                bad = [n for n in names if n and n.split(".")[0] in helpers]
                assert not bad, f"{f}: imports {bad} from tests/"


RUNTIME_LINES = 650     # the most any module of the package may hold (issue 29)
DECODE_LINES = 350      # the file that defines decode: the loop reads as the algorithm


def _lines(f: Path) -> int:
    return len(f.read_text().splitlines())


def test_no_module_is_over_650_lines_and_the_loop_over_350():
    too_long = {f"{name} ({_lines(f)} lines)" for name, f in _modules().items()
                if _lines(f) > RUNTIME_LINES}
    assert not too_long, f"over {RUNTIME_LINES} lines: {', '.join(sorted(too_long))}"
    # the round's steps read as the algorithm; the one driver that runs them is the batch's
    loop = ROOT / "mlx_dspark" / "decode" / "loop.py"
    assert "\ndef decode(" in (ROOT / "mlx_dspark" / "decode" / "batch.py").read_text()
    assert _lines(loop) <= DECODE_LINES, f"decode/loop.py has {_lines(loop)} lines"
