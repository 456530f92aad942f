"""The built wheel, installed in a fresh environment, has every package, template and console command (integration).

The editable install of the development environment finds any module of the source tree, listed in pyproject or
not; a user who installs the wheel gets only what pyproject lists.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tomllib
import venv

import pytest

pytestmark = pytest.mark.integration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_wheel_in_a_fresh_environment_runs_every_console_command(tmp_path):
    source = tmp_path / "source"  # a copy: an in-tree build leaves build/ and *.egg-info in the project
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in files:
        if os.path.isfile(os.path.join(REPO, name)):
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp_path), source],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("rlhf_pipeline-*.whl")
    fresh = tmp_path / "fresh"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    # the dependencies come from this environment's site-packages as a plain path: a .pth line adds the folder,
    # not the .pth files in it, so the editable install's finder stays out and only the wheel provides our code
    (found,) = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    with open(os.path.join(found, "dependencies.pth"), "w") as handle:
        handle.write("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    probe = subprocess.run(
        [python, "-c", "import tasks.kit.model_card, rlhf.report.render, tasks; print(tasks.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]  # the templates are read at import
    assert probe.stdout.strip().startswith(found), probe.stdout  # the wheel's copy, not the source tree
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        commands = tomllib.load(handle)["project"]["scripts"]
    assert {"rlhf-registry", "rlhf-model", "rlhf-review", "rlhf-housekeeping", "rlhf-deploy"} <= set(commands)
    for command in commands:
        result = subprocess.run(
            [fresh / "bin" / command, "--help"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0 and "Usage" in result.stdout, f"{command}: {result.stdout}{result.stderr}"
