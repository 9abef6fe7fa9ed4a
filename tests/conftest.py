"""Shared test setup. The helpers, references and scaffolding live in the checkout's
``testkit/`` (pyproject's ``pythonpath`` puts the checkout on ``sys.path``); the committed tiny
drafter fixture's module imports as ``fixtures.drafter.tiny`` because pytest puts this folder on
``sys.path`` (rootdir-relative, no ``__init__.py``)."""

import builtins
import dis
import importlib
import importlib.util
import inspect
import os
import signal
import socket
import subprocess
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

# The processes the tests start (CLI runs, servers, ``python -c`` probes) import testkit/ from
# the checkout too, as the tests do through pyproject's ``pythonpath``.
_CHECKOUT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_CHECKOUT, os.environ.get("PYTHONPATH")]))

# A runner started in the background by a shell without job control (a CI script's `cmd &`,
# nohup) inherits SIGINT ignored, and so would every process the tests start: the Ctrl-C tests
# send SIGINT and need it delivered. A caught signal is reset to its default across exec, so
# catching it here gives the children Python's own Ctrl-C.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """mlx-dspark's cache (the hashes recorded at the first load of a directory without a
    receipt, converted repo ids) is the run's own, never the user's; child processes inherit
    it. Tests that need their own still set MLX_DSPARK_CACHE."""
    before = os.environ.get("MLX_DSPARK_CACHE")
    os.environ["MLX_DSPARK_CACHE"] = str(tmp_path_factory.mktemp("mlx-dspark-cache"))
    yield
    if before is None:
        os.environ.pop("MLX_DSPARK_CACHE", None)
    else:
        os.environ["MLX_DSPARK_CACHE"] = before


@pytest.fixture
def template_calls(monkeypatch):
    """``watch(tokenizer)`` returns the list of the keyword arguments of every later
    ``apply_chat_template`` call on tokenizers of its class (what reached the template)."""
    def watch(tokenizer):
        calls, real = [], type(tokenizer).apply_chat_template

        def spy(self, *a, **kw):
            calls.append(kw)
            return real(self, *a, **kw)
        monkeypatch.setattr(type(tokenizer), "apply_chat_template", spy)
        return calls
    return watch


# --- the unit lane (`pytest -m unit`): every test that needs no model, server or subprocess
#
# A test is marked ``unit`` at collection unless it is slow or long, or what it runs reaches
# something that loads a checkpoint, builds a model, serves, starts a process or runs code from
# text (``_heavy``): found by following, through the bytecode, every global and attribute the
# test function, its fixtures and the helpers they call (in tests/ and testkit)
# name. What the walk misses is caught when it runs: a unit test that reads a checkpoint,
# builds a model, starts a process or listens on a socket fails, naming what it did, so the
# lane can neither slow down nor pass unnoticed.


def _walked_folders() -> tuple[str, ...]:
    import testkit
    return tuple(str(Path(f).parent.resolve()) for f in (__file__, testkit.__file__))


_WALKED = _walked_folders()


def _heavy() -> dict:
    """What a unit test may not reach, by identity, with the reason."""
    import mlx.core as mx
    import pexpect
    import pexpect.popen_spawn
    from starlette.testclient import TestClient

    from mlx_lm.models import nemotron_h as mlx_lm_nemotron_h

    from mlx_dspark import api, cli, drafters
    from mlx_dspark.cli import common
    from mlx_dspark.models import nemotron_h, weights
    from mlx_dspark.serve.app import create_app
    from mlx_dspark.serve.engine import Engine
    process = [subprocess.Popen, subprocess.run, subprocess.call, subprocess.check_call,
               subprocess.check_output, pexpect.spawn, pexpect.popen_spawn.PopenSpawn]
    model = [api.load, nemotron_h.load_target, drafters.load_drafter, common.load_pair,
             weights.read_weights, mx.load, cli.main]
    if importlib.util.find_spec("mlx_vlm") is not None:     # the omni extra's own loader
        from mlx_vlm.utils import load_model as mlx_vlm_load
        model.append(mlx_vlm_load)
    server = [Engine, create_app, TestClient]
    # a whole network, even a tiny random one (testkit/toy.py): decoding on it is
    # what makes a test take seconds
    built = [*_model_classes(), mlx_lm_nemotron_h.Model]
    unseen = [builtins.exec, builtins.eval]      # what it runs, the walk cannot follow
    return {id(o): why for objects, why in ((process, "starts a process"),
                                            (unseen, "runs code from text"),
                                            (model, "loads a checkpoint"),
                                            (built, "builds a model"),
                                            (server, "serves")) for o in objects}


def _model_classes() -> list:
    """The classes of a whole target or drafter."""
    from mlx_dspark.drafters.base import DrafterBase
    from mlx_dspark.models.nemotron_h import NemotronH
    out, todo = [NemotronH], [DrafterBase]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def _code_objects(code):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_objects(c)


_NAMED: dict = {}      # id -> (the function, kept so that its id stays its own; what it names)


def _named(func) -> list:
    """The objects ``func``'s code names: its globals, their attributes, its imports."""
    if id(func) not in _NAMED:
        _NAMED[id(func)] = (func, list(_naming(func)))
    return _NAMED[id(func)][1]


def _naming(func):
    glob = getattr(func, "__globals__", {})
    for code in _code_objects(func.__code__):
        obj, local, imported = None, {}, None
        for ins in dis.get_instructions(code):
            name = ins.argval
            if ins.opname in ("STORE_FAST", "STORE_DEREF", "STORE_NAME") and obj is not None:
                # ``import a.b`` binds the package a; ``from a import b``, ``import a as c``
                local[name] = sys.modules.get(imported.split(".")[0]) if imported else obj
                obj = imported = None
                continue
            imported = None
            if ins.opname == "LOAD_GLOBAL":
                obj = glob.get(name, getattr(builtins, name, None))
            elif ins.opname in ("LOAD_FAST", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_NAME"):
                obj = local.get(name)
            elif ins.opname == "IMPORT_NAME":
                obj, imported = _module(name), name
            elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "IMPORT_FROM") and obj is not None:
                try:
                    obj = inspect.getattr_static(obj, name)
                except AttributeError:
                    obj = getattr(obj, name, None) if isinstance(obj, types.ModuleType) else None
            else:
                obj = None
                continue
            if obj is not None:
                yield obj


def _module(name: str):
    """The module an import inside a function names: one already imported, or a helper of
    tests/ (imported now, so the walk can follow it even when this run did not collect it)."""
    if name in sys.modules:
        return sys.modules[name]
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not str(Path(spec.origin).resolve()).startswith(_WALKED):
        return None
    return importlib.import_module(name)


def _walked(obj) -> bool:
    try:
        return str(Path(inspect.getfile(obj)).resolve()).startswith(_WALKED)
    except (TypeError, OSError):
        return False


def _reaches(func, heavy: dict, seen: set) -> str | None:
    """Why ``func`` (a test, a fixture, a helper) is not a unit test, or None."""
    for obj in _named(func):
        if isinstance(obj, (staticmethod, classmethod)):
            obj = obj.__func__
        if id(obj) in heavy:
            return f"{heavy[id(obj)]} ({getattr(obj, '__qualname__', obj)})"
        if id(obj) in seen or not _walked(obj):
            continue
        seen.add(id(obj))
        parts = [obj] if inspect.isfunction(obj) else [
            v for v in vars(obj).values() if inspect.isfunction(v)] if inspect.isclass(obj) \
            else []
        for part in parts:
            if why := _reaches(part, heavy, seen):
                return why
    return None


def _not_unit(item, heavy: dict) -> str | None:
    if item.get_closest_marker("slow") or item.get_closest_marker("long"):
        return "slow"
    funcs = [getattr(item, "function", None)] + [
        d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
    seen: set = set()
    for func in funcs:
        if func is not None and hasattr(func, "__code__") and (why := _reaches(func, heavy, seen)):
            return why
    return None


def pytest_collection_modifyitems(config, items):
    heavy = _heavy()
    for item in items:
        if _not_unit(item, heavy) is None:
            item.add_marker(pytest.mark.unit)


class NotAUnitTest(Exception):
    """A test marked unit did what the unit lane leaves out."""


def _refuse(what: str):
    def refuse(*args, **kwargs):
        raise NotAUnitTest(f"a unit test {what}: mark it slow, or do it through a helper that "
                           f"the walk in tests/conftest.py can follow")
    return refuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    with _guarded(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    with _guarded(item):
        yield


@contextmanager
def _guarded(item):
    """While a unit test (and its fixtures) runs, what it may not do raises NotAUnitTest."""
    if item.get_closest_marker("unit") is None:
        yield
        return
    import mlx.core as mx
    refused = [(subprocess.Popen, "__init__", "started a process"),
               (socket.socket, "listen", "listened on a socket"),
               (mx, "load", "read a checkpoint")] + [
        (cls, "__init__", f"built a model ({cls.__name__})") for cls in _model_classes()]
    saved = [(o, n, vars(o).get(n)) for o, n, _ in refused]
    for o, n, what in refused:
        setattr(o, n, _refuse(what))
    try:
        yield
    finally:
        for o, n, v in reversed(saved):
            if v is None:           # inherited: it goes back to being so
                delattr(o, n)
            else:
                setattr(o, n, v)
