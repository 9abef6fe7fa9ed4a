"""The open-file limit: importing mlx-lm (which sets it to (2048, 4096)) neither fails under a
hard limit below 4096 nor lowers a higher one; the soft limit only rises within the hard."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

READ = ("import resource, mlx_dspark.api, mlx_dspark.text.tokenizer; "
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")


def _run(soft, hard, code=READ):
    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return subprocess.run([sys.executable, "-c", code], preexec_fn=limit, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("soft,hard,want", [(256, 1024, (1024, 1024)),
                                             (1024, 20000, (2048, 20000)),
                                             (8192, 20000, (8192, 20000))])
def test_importing_mlx_lm_keeps_within_the_hard_limit_and_never_lowers_it(soft, hard, want):
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < hard:
        pytest.skip(f"this machine's hard open-file limit is below {hard}")
    r = _run(soft, hard)
    assert r.returncode == 0, r.stderr[-2000:]
    assert tuple(map(int, r.stdout.split())) == want


def test_a_command_runs_under_a_hard_limit_below_4096():
    r = _run(256, 1024, "import sys; from mlx_dspark.cli import main; "
                        "sys.exit(main(['generate', '-p', 'Hi', '-m', '4']))")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip()
