"""The torch version matrix: the torchfix tests on one release per torch minor, 2.0 - 2.15.

    nox -l                      # list sessions
    nox -s "shim(torch2.13)"    # one release (ids are not bare numbers: nox would read "2.10" as 2.1), but the
                                #   tests marked release_independent (torchfix's own machinery)
    nox -s shim                 # the whole matrix (downloads ~3 GB per release)
    nox -s tests                # the full suite (trainer included) on the default torch
    nox -s dflash_client        # an exported drafter in z-lab's reference DFlash client
    nox -s transformers_floor   # dflash_train on the oldest transformers pyproject.toml allows

Each session asserts that the torch it runs on is the one it asked for. The torch 2.0 session needs a
python3.10 on PATH (with pyenv: PYENV_VERSION=3.11.7:3.10.13).
"""

import os
import subprocess
from pathlib import Path

import nox

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests"]
nox.options.error_on_missing_interpreters = True

DEFAULT_TORCH = "2.13.0"
# One release per minor: (python, torch). torch 2.0's torch.compile does not support Python 3.11.
RELEASES = [
    ("3.10", "2.0.1"),
    ("3.11", "2.1.2"),
    ("3.11", "2.2.2"),
    ("3.11", "2.3.1"),
    ("3.11", "2.4.1"),
    ("3.11", "2.5.1"),
    ("3.11", "2.6.0"),
    ("3.11", "2.7.1"),
    ("3.11", "2.8.0"),
    ("3.11", "2.9.1"),
    ("3.11", "2.10.0"),
    ("3.11", "2.11.0"),
    ("3.11", "2.12.1"),
    ("3.11", "2.13.0"),
    ("3.11", "2.14.1"),
    ("3.11", "2.15.0"),
]
SHIM_TESTS = sorted(str(p) for p in Path("tests").glob("test_torchfix_*.py"))


def install_torch(session: nox.Session, torch: str) -> None:
    major_minor = tuple(int(part) for part in torch.split(".")[:2])
    # Releases before 2.3 were built against NumPy 1.x.
    extra = ["numpy<2"] if major_minor < (2, 3) else []
    if major_minor > (2, 14):
        # This workplace's pip config caps torch at the releases kept on local disk; go past it.
        session.env["PIP_CONFIG_FILE"] = "/dev/null"
    session.install(f"torch=={torch}", *extra)
    session.install("-e", ".", "pytest", "pytest-xdist")
    assert_torch(session, torch)


def assert_torch(session: nox.Session, torch: str) -> None:
    session.run(
        "python",
        "-c",
        f"import torch, sys; v = torch.__version__.split('+')[0]; "
        f"sys.exit(0 if v == '{torch}' else f'asked for torch {torch}, got {{torch.__version__}}')",
    )


PURELIB = "import sysconfig; print(sysconfig.get_paths()['purelib'])"


def install_default_torch(session: nox.Session, *packages: str) -> None:
    """torch DEFAULT_TORCH, the project with its test extra, and ``packages``. CI (.ci/run) sets NOX_REUSE_VENV to
    the README's venv, which has the first two: the session then adds that venv's site-packages to its own,
    after them (a .pth file), instead of installing torch again; what it installs itself comes first."""
    reuse = os.environ.get("NOX_REUSE_VENV")
    if reuse:
        theirs = subprocess.run([f"{reuse}/bin/python", "-c", PURELIB], capture_output=True, text=True, check=True)
        ours = session.run_install("python", "-c", PURELIB, silent=True).strip()
        Path(ours, "_reused_venv.pth").write_text(theirs.stdout)
    else:
        session.install(f"torch=={DEFAULT_TORCH}")
    session.install("-e", ".[test]", *packages)
    assert_torch(session, DEFAULT_TORCH)


@nox.session
@nox.parametrize("python,torch", RELEASES, ids=[f"torch{torch.rsplit('.', 1)[0]}" for _, torch in RELEASES])
def shim(session: nox.Session, torch: str) -> None:
    """torchfix's tests on one torch release, but those of its own machinery (the same on every torch)."""
    install_torch(session, torch)
    session.run("python", "-m", "pytest", "-q", "-m", "not release_independent", *SHIM_TESTS, *session.posargs)


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole suite on the default torch."""
    install_default_torch(session)
    session.run("python", "-m", "pytest", "-q", *session.posargs)


# The oldest transformers dflash_train is tested with: the floor of its `train` extra in pyproject.toml.
TRANSFORMERS_FLOOR = "5.17.0"


@nox.session(python="3.11")
def transformers_floor(session: nox.Session) -> None:
    """dflash_train's unit and training tests on the oldest transformers its `train` extra allows."""
    install_default_torch(session, f"transformers=={TRANSFORMERS_FLOOR}")
    session.run("python", "-c", f"import transformers; assert transformers.__version__ == '{TRANSFORMERS_FLOOR}'")
    session.run("python", "-m", "pytest", "-q", "tests/test_dflash_units.py", "tests/test_dflash_training.py")


@nox.session(python="3.11")
def dflash_client(session: nox.Session) -> None:
    """An exported drafter in z-lab's reference DFlash client (its package, without its pinned extras)."""
    install_default_torch(session)
    session.install("--no-deps", "dflash==0.1.0")
    session.run("python", "-c", "import dflash.model")  # the test below would skip without it
    session.run("python", "-m", "pytest", "-q", "tests/test_dflash_client.py", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """The benchmarks (see BENCHMARKS.md)."""
    session.install(f"torch=={DEFAULT_TORCH}")
    session.install("-e", ".[train]")
    session.run("python", "-m", "bench", *session.posargs)
