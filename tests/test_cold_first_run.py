"""A cold first run is not a mystery (issue 25, item 4): loading runs every kernel a generation
runs (serial steps, full rounds of the requested drafts) before anything is timed, without
touching what "auto" learns, and the command line says when MLX is about to compile its CPU
kernels (a fresh machine: its disk cache is empty)."""

from __future__ import annotations

import tempfile

import pytest

import mlx_dspark as md
from mlx_dspark import cli, loading
from mlx_dspark.models.nemotron_h import NemotronH


@pytest.fixture
def shapes(monkeypatch):
    """The token shapes the target steps and verifies."""
    seen = []
    for name in ("step", "verify"):
        real = getattr(NemotronH, name)

        def spy(self, tokens, *a, _real=real, _name=name, **kw):
            seen.append((_name, tuple(tokens.shape)))
            return _real(self, tokens, *a, **kw)
        monkeypatch.setattr(NemotronH, name, spy)
    return seen


def test_load_runs_serial_steps_and_full_rounds_before_returning(shapes):
    pair = md.load()
    assert ("step", (1, 1)) in shapes                # a serial step
    assert ("verify", (1, 4)) in shapes              # a round of 3 drafts (the default)
    assert pair.controller is None                   # "auto" learns nothing from cold timings


def test_the_command_line_warms_the_drafts_it_will_use_before_the_prompt(shapes, capsys):
    prompt = "def fibonacci(n):"
    assert cli.main(["generate", "-p", prompt, "-m", "1", "--num-draft", "5",
                     "--ignore-chat-template"]) == 0
    n = len(md.load(warm=False).tokenizer.encode(prompt))
    assert n > 2                                     # longer than the warm-up's prompt
    assert shapes.index(("verify", (1, 6))) < shapes.index(("step", (1, n)))


def test_kernel_cache_cold_means_an_empty_mlx_cache(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert loading.kernel_cache_cold()
    import mlx.core as mx
    cache = tmp_path / "mlx" / mx.__version__ / "cpu"
    cache.mkdir(parents=True)
    (cache / "libkernel.so").write_bytes(b"")
    assert not loading.kernel_cache_cold()


@pytest.mark.parametrize("cold", [True, False])
def test_the_first_run_says_it_compiles_kernels(monkeypatch, capsys, cold):
    monkeypatch.setattr(loading, "kernel_cache_cold", lambda: cold)
    assert cli.main(["generate", "-p", "x", "-m", "1", "--ignore-chat-template"]) == 0
    err = capsys.readouterr().err
    said = ("mlx-dspark generate: first run on this machine: MLX compiles its CPU kernels now "
            "(about a minute; later runs reuse them)\n")
    assert (said in err) == cold


def test_the_warm_up_prefills_past_the_short_block_kernels(shapes):
    """Issue 41: the warm-up's 2-token prompt never ran the kernels a real prompt's prefill
    runs (longer than the fused norm's rows and the serial SSM recurrence), so the first
    ``--stats`` timed their compilation: a 49-token prefill at 19-22 tokens/s, 940 warm."""
    from mlx_dspark.kernels.norm import FUSED_ROWS
    from mlx_dspark.models.nemotron_h import SERIAL_MAX
    md.load()
    prefills = [shape[1] for name, shape in shapes if name == "step"]
    assert max(prefills) > max(FUSED_ROWS, SERIAL_MAX)
