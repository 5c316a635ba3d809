"""The package installs: ``python -m build`` gives an sdist and a wheel, and the wheel installed
in a fresh virtualenv runs on its own files (never this checkout's): ``privreg --version``, the
native kernel it compiled (or the gmpy2 fallback without it) and ``privreg demo``.

The fresh virtualenv has no pip and downloads nothing: the project venv's pip installs the
wheel into it (``--no-deps --no-index``), and a .pth file after the install lends it the
project venv's site-packages for the dependencies. Its own site-packages comes first on
sys.path, so the wheel's modules and metadata win over the editable install found there.

The whole demo takes minutes on two cores, so the demo runs one bundled sub-job (label DP:
load, PSI, a label-DP release); the packaging is the same for every job of the demo.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_paillier_native import ROUND_TRIP

from privreg import bundled

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@dataclass(frozen=True)
class Installed:
    """The built distributions and the virtualenv the wheel went into."""

    sdist: Path
    wheel: Path
    venv: Path
    site: Path  # the fresh venv's site-packages
    env: dict[str, str]

    def run(self, *args: str, cwd: Path, timeout: float = 60) -> str:
        """A command of the fresh venv (``privreg`` or ``python``); its stdout."""
        result = subprocess.run(
            [str(self.venv / "bin" / args[0]), *args[1:]],
            cwd=cwd,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert result.returncode == 0, f"{args} exited {result.returncode}:\n{result.stderr}"
        return result.stdout


def _check(command: list[str]) -> str:
    """Run a step of the build or install; its stdout, or a failure showing its stderr."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stderr}"
    return result.stdout.strip()


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """Build from this checkout (no isolation: the dev extra's setuptools, nothing fetched),
    then install the wheel into a fresh venv."""
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    _check([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)])
    (sdist,) = dist.glob("privreg-*.tar.gz")
    (wheel,) = dist.glob("privreg-*.whl")
    venv = tmp / "venv"
    _check([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = str(venv / "bin" / "python")
    _check([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
            str(wheel)])  # fmt: skip
    site = Path(_check([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]))
    dependencies = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (site / "project_dependencies.pth").write_text("\n".join(sorted(dependencies)) + "\n")
    drop = ("PYTHONPATH", "PREFECT_", "PRIVREG_", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PYTHONNOUSERSITE"] = "1"
    return Installed(sdist, wheel, venv, site, env)


def test_the_sdist_holds_the_kernels_source_and_the_demo_but_no_built_kernel(
    installed: Installed,
) -> None:
    with tarfile.open(installed.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert "core/paillier/_montgomery.c" in names
    assert "core/psi_ot/_band.c" in names
    assert set(bundled.demo_files(ROOT)) <= names
    assert not [name for name in names if name.endswith((".so", ".pyd"))]


def test_the_installed_privreg_is_the_wheels_and_prints_pyprojects_version(
    installed: Installed, tmp_path: Path
) -> None:
    assert installed.run("privreg", "--version", cwd=tmp_path).strip() == f"privreg {VERSION}"
    code = "import core, flows, privreg; print(core.__file__, flows.__file__, privreg.__file__)"
    for module_file in installed.run("python", "-c", code, cwd=tmp_path).split():
        assert Path(module_file).is_relative_to(installed.site), module_file
    assert "privreg demo" in installed.run("privreg", "--help", cwd=tmp_path)


def test_the_wheel_carries_every_file_the_demo_names(installed: Installed, tmp_path: Path) -> None:
    code = (
        "from privreg import bundled\n"
        "root = bundled.demo_root()\n"
        "print(root)\n"
        "print(*bundled.demo_files(root))\n"
    )
    root, files = installed.run("python", "-c", code, cwd=tmp_path).splitlines()
    assert Path(root) == installed.site / "privreg" / bundled.PACKAGED
    assert files.split() == bundled.demo_files(ROOT)  # sources, sub-jobs: all of them, no more


def test_the_wheel_runs_its_own_kernel_and_gmpy2_without_it(
    installed: Installed, tmp_path: Path
) -> None:
    """With a kernel in the wheel it must load from the install; without one (no compiler
    when the wheel was built, or its file gone) the same round trip runs on gmpy2."""
    with zipfile.ZipFile(installed.wheel) as wheel:
        built = [n for n in wheel.namelist() if n.startswith("core/paillier/_montgomery.")]
    assert "core/paillier/_montgomery.c" not in built  # the source stays in the sdist
    kernels = [installed.site / name for name in built]
    available, path = installed.run("python", "-c", ROUND_TRIP, cwd=tmp_path).split()
    if kernels:
        assert (available, path != "None") == ("True", True)
        code = "from core.paillier import _montgomery; print(_montgomery.__file__)"
        loaded = Path(installed.run("python", "-c", code, cwd=tmp_path).strip())
        assert loaded in kernels
    else:
        assert (available, path) == ("False", "None")
    aside = [kernel.rename(kernel.with_name(kernel.name + ".aside")) for kernel in kernels]
    try:
        fallback = installed.run("python", "-c", ROUND_TRIP, cwd=tmp_path).split()
    finally:
        for moved, kernel in zip(aside, kernels, strict=True):
            moved.rename(kernel)
    assert fallback == ["False", "None"]


def test_the_wheel_runs_its_own_psi_kernel(installed: Installed, tmp_path: Path) -> None:
    """The RR22 kernel, when the wheel has one, loads from the install (not a checkout)."""
    with zipfile.ZipFile(installed.wheel) as wheel:
        built = [n for n in wheel.namelist() if n.startswith("core/psi_ot/_band.")]
    code = "from core.psi_ot import native; print(native.available())"
    assert installed.run("python", "-c", code, cwd=tmp_path).strip() == str(bool(built))
    if built:
        code = "from core.psi_ot import _band; print(_band.__file__)"
        loaded = Path(installed.run("python", "-c", code, cwd=tmp_path).strip())
        assert loaded in [installed.site / name for name in built]


def test_privreg_demo_writes_its_folder_and_runs_a_bundled_job_there(
    installed: Installed, tmp_path: Path
) -> None:
    out = installed.run(
        "privreg", "demo", "--dir", "mine", "--job", "label_dp", cwd=tmp_path, timeout=240
    )
    folder = tmp_path / "mine"
    assert f"The demo's folder: {folder}" in out
    assert "| registry | label_dp_demo/label_dp |" in out  # the run's summary table
    for name in bundled.demo_files(ROOT):
        assert (folder / name).read_bytes() == (ROOT / name).read_bytes()
    for party in ("registry", "clinic_baseline"):
        assert (folder / "var" / "parties" / f"{party}.duckdb").is_file()
    assert (folder / "var" / "prefect").is_dir()  # Prefect's state beside the run, not ~
    assert list((folder / "var" / "logs").glob("label_dp_demo-*.log"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # nothing outside its folder


def test_a_checkout_reads_the_demo_where_make_demo_does(tmp_path: Path) -> None:
    """No package data in a checkout or an editable install: the repository's own files."""
    assert bundled.demo_root() == ROOT
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "demo.json").write_text('{"parties": {"guest": {"source": "a.csv"}}}')
    with pytest.raises(FileNotFoundError, match=r"guest's source a\.csv"):
        bundled.demo_files(tmp_path)  # what fails a build that would ship a broken demo
