"""``python -m torchfix``: the doctor report, the diffs (of one release, or patches/ for all), a soak test, and
running a program with torchfix loaded."""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import runpy
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Callable
from pathlib import Path

import torchfix

from . import fixes
from ._fix import Fix, State
from ._install import module_file_exists
from .doctor import stress
from .patching.config import config_is_per_thread
from .patching.source import ShapeError

PTH_NAME = "torchfix-autoload.pth"


def _load_triggers() -> None:
    """Import what each fix waits for (Dynamo, say), so every status is final rather than pending. A trigger
    this torch does not have (``torch.export._trace`` before 2.3) made its fixes "not needed" already."""
    for fix in fixes.ALL:
        if module_file_exists(fix.trigger):
            importlib.import_module(fix.trigger)


def doctor(selftest: bool) -> int:
    import torch

    from .doctor import selftest

    _load_triggers()

    print(f"torchfix {torchfix.__version__}")
    print(f"python {platform.python_version()}, torch {torch.__version__} ({os.path.dirname(torch.__file__)})")
    for variable in ("TORCHFIX_DISABLE", "TORCHFIX_STRICT"):
        print(f"{variable}={os.environ.get(variable, '')!r}")
    print("\nfixes:")
    problems = 0
    by_name = {fix.name: fix for fix in fixes.ALL}
    for entry in torchfix.status():
        problems += entry.state is State.UNSUPPORTED and not by_name[entry.name].hazard_is_cost
        print(f"  {entry.name:<26} {entry.state.value:<14} {entry.reason}")
        print(f"  {'':<26} hazard: {by_name[entry.name].hazard}")
    if config_is_per_thread():
        print(
            "\nconfig: per thread (torch 2.12+): torch._dynamo/_inductor config set in one thread is not seen in other"
        )
        print("        threads (nor autograd's, where backward graphs compile): call torchfix.propagate_config() after")
        print("        configuring, to make those settings the process's")
    if selftest:
        print("\nself-test (the hazards, forced with events in live threads):")
        for result in selftest.run_all(timeout=60.0):
            problems += result.hazard
            print(f"  {'FAIL' if result.hazard else 'pass'}  {result.scenario}: {result.detail[:160]}")
    print(f"\n{'OK' if not problems else f'{problems} problem(s)'}")
    return 1 if problems else 0


def status() -> int:
    """Each fix's state on this torch and why: the doctor's list, without the self-test."""
    import torch  # noqa: F401  (the fixes wait for it)

    _load_triggers()
    for entry in torchfix.status():
        print(f"{entry.name:<26} {entry.state.value:<14} {entry.reason}")
    return 0


def _installed_reader(relpath: str) -> str:
    import torch

    return (Path(torch.__file__).parent.parent / relpath).read_text(encoding="utf-8")


def diff(source_root: str | None, torch_version: str | None, output_dir: str | None) -> int:
    """Print (or write, one file per fix) the diffs of every fix that applies to a torch release.

    Without ``--source-root`` that is the installed torch; with it, a tree holding ``torch/**.py`` of
    any release (``--torch-version`` says which), which is how ``patches/`` is generated.
    """
    if source_root:
        if not torch_version:
            print("--source-root needs --torch-version", file=sys.stderr)
            return 2

        def read(relpath: str) -> str:
            return (Path(source_root) / relpath).read_text(encoding="utf-8")

        wanted = [fix for fix in fixes.ALL if fix.supports(torch_version)]
    else:
        import torch

        _load_triggers()
        torch_version, read = str(torch.__version__), _installed_reader
        states = {entry.name: entry for entry in torchfix.status()}
        wanted = []
        for fix in fixes.ALL:
            if states[fix.name].state in (State.NOT_NEEDED, State.UNSUPPORTED):
                print(f"# {fix.name}: {states[fix.name].state.value} ({states[fix.name].reason})")
            else:
                wanted.append(fix)
    return 1 if _write_diffs(wanted, torch_version, read, output_dir) else 0


def _write_diffs(
    wanted: list[Fix], torch_version: str, read: Callable[[str], str], output_dir: str | Path | None
) -> int:
    """Each fix's diff to stdout or to ``output_dir/<fix>.diff``; the number of fixes that had none."""
    failed = 0
    for fix in wanted:
        try:
            text = fix.diff(torch_version, read)
        except (ShapeError, OSError) as exc:
            print(f"# {fix.name}: cannot build the diff for torch {torch_version}: {exc}", file=sys.stderr)
            failed += 1
            continue
        if output_dir:
            Path(output_dir).mkdir(parents=True, exist_ok=True)
            (Path(output_dir) / f"{fix.name}.diff").write_text(text, encoding="utf-8")
        else:
            sys.stdout.write(text)
    return failed


def patches(directory: str, releases: list[str], wheels: str | None) -> int:
    """Regenerate ``directory/<release>/<fix>.diff`` for every release already there and every ``--release``,
    from each release's torch wheel: downloaded by pip into ``wheels`` (kept there for the next run), never
    installed, read as the zip it is. What a release's folder held before is replaced."""
    root = Path(directory)
    present = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")} if root.is_dir() else set()
    wanted_releases = sorted({*present, *releases})
    if not wanted_releases:
        print(f"{directory}: no release folders, and no --release given", file=sys.stderr)
        return 2
    store = Path(wheels) if wheels else root / ".wheels"
    failed = 0
    for version in wanted_releases:
        wheel = _torch_wheel(version, store)
        if wheel is None:
            failed += 1
            continue
        with zipfile.ZipFile(wheel) as archive:
            out = root / version
            for stale in out.glob("*.diff"):
                stale.unlink()
            wanted = [fix for fix in fixes.ALL if fix.supports(version)]
            failed += _write_diffs(wanted, version, _reader_of(archive), out)
        print(f"{version}: {len(list(out.glob('*.diff')))} diffs from {wheel.name}")
    return 1 if failed else 0


def _reader_of(archive: zipfile.ZipFile) -> Callable[[str], str]:
    def read(relpath: str) -> str:
        try:
            return archive.read(relpath).decode("utf-8")
        except KeyError:  # patches take a file the release lacks as "nothing to edit there"
            raise FileNotFoundError(f"{archive.filename} has no {relpath}") from None

    return read


def _torch_wheel(version: str, store: Path) -> Path | None:
    """A torch ``version`` wheel in ``store``, downloaded there first if there is none."""
    pattern = f"torch-{version}[-+]*.whl"  # a local version (2.13.0+cpu) or a build tag may follow
    if not any(store.glob(pattern)):
        download = [sys.executable, "-m", "pip", "download", "-q", f"torch=={version}", "--no-deps", "-d", str(store)]
        if subprocess.run(download).returncode != 0:
            print(f"{version}: pip could not download torch=={version}", file=sys.stderr)
            return None
    return next(iter(sorted(store.glob(pattern))), None)


def docs(doc: str, readme: str, survey: str, check: bool) -> int:
    """Write docs/fixes.md, the README's list of fixes and the survey's verdicts (or, with ``check``, say which would
    change)."""
    from . import _fixes_doc

    try:
        differ = _fixes_doc.write(Path(doc), Path(readme) if readme else None, check, Path(survey) if survey else None)
    except (OSError, ValueError) as exc:
        print(f"python -m torchfix docs: {exc}", file=sys.stderr)
        return 2
    for path in differ:
        print(f"{path}: {'out of date' if check else 'written'}")
    return 1 if check and differ else 0


def run(target: list[str]) -> int:
    """Run a script (``run path.py args``) or module (``run -m name args``) with torchfix installed."""
    if not target:
        print("usage: python -m torchfix run script.py [args...] | -m module [args...]", file=sys.stderr)
        return 2
    if target[0] == "-m":
        if len(target) < 2:
            print("run -m needs a module name", file=sys.stderr)
            return 2
        sys.argv = target[1:]
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = target
        sys.path.insert(0, os.path.dirname(os.path.abspath(target[0])))
        runpy.run_path(target[0], run_name="__main__")
    return 0


def pth(action: str, site_dir: str | None) -> int:
    """Load torchfix in every interpreter of this environment (subprocesses, DataLoader workers)."""
    path = Path(site_dir or sysconfig.get_paths()["purelib"]) / PTH_NAME
    if action == "install":
        # A .pth line that starts with "import" runs at interpreter start-up. Importing torchfix only
        # registers a hook when torch is not imported, so interpreters that never use torch pay ~ms.
        path.write_text("import torchfix\n", encoding="utf-8")
        print(f"wrote {path}")
    else:
        path.unlink(missing_ok=True)
        print(f"removed {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m torchfix",
        description="The doctor report, each fix's state, the diffs (of one release, or patches/ for all), a soak "
        "test, and running a program with torchfix loaded.",
    )
    commands = parser.add_subparsers(dest="command")
    doctor_parser = commands.add_parser("doctor", help="versions, each fix's state, live self-test (default)")
    doctor_parser.add_argument("--no-selftest", action="store_true", help="skip the live races")
    commands.add_parser("status", help="each fix's state on this torch and why (the doctor's list, no self-test)")
    diff_parser = commands.add_parser("diff", help="unified diffs of the fixes for a torch release")
    diff_parser.add_argument("--source-root", help="a tree with torch/**.py of some release (default: installed)")
    diff_parser.add_argument("--torch-version", help="the release of --source-root, e.g. 2.5.1")
    diff_parser.add_argument("--output-dir", help="write <fix>.diff files here instead of printing")
    patches_parser = commands.add_parser(
        "patches", help="regenerate a folder of per-release diffs (patches/) from downloaded torch wheels"
    )
    patches_parser.add_argument("directory", help="holds one folder per release, named by its version")
    patches_parser.add_argument("--release", action="append", default=[], help="add this release (repeatable)")
    patches_parser.add_argument("--wheels", help="where the wheels are kept (default: DIRECTORY/.wheels)")
    docs_parser = commands.add_parser(
        "docs",
        help="write the table of fixes (docs/fixes.md), the README's list and the survey's verdicts from the fixes' "
        "declarations",
    )
    docs_parser.add_argument("--doc", default="docs/fixes.md", help="the table's file (default: docs/fixes.md)")
    docs_parser.add_argument("--readme", default="README.md", help="the README whose list to rewrite ('' for none)")
    docs_parser.add_argument(
        "--survey",
        default="docs/torch-2.15-globals.md",
        help="the survey of torch's state whose verdicts and counts to rewrite ('' for none)",
    )
    docs_parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file would change")
    watch_parser = commands.add_parser(
        "watch", help="run a program and report the process state one thread changed where other threads saw it"
    )
    watch_parser.add_argument("--interval", type=float, default=0.02, help="seconds between samples (0.02)")
    watch_parser.add_argument("--json", help="also write the report to this file")
    watch_parser.add_argument("target", nargs=argparse.REMAINDER, help="-- script.py args (or -m module args)")
    run_parser = commands.add_parser("run", help="run a script or -m module with torchfix loaded")
    run_parser.add_argument("target", nargs=argparse.REMAINDER)
    stress_parser = commands.add_parser(
        "stress", help="randomized soak: threads tracing, compiling and exporting at once, torchfix on and off"
    )
    stress.add_arguments(stress_parser)
    pth_parser = commands.add_parser("pth", help=f"install or remove {PTH_NAME} (torchfix in every interpreter)")
    pth_parser.add_argument("action", choices=["install", "remove"])
    pth_parser.add_argument("--site-dir", help="the site-packages to write to (default: this environment's)")
    args = parser.parse_args(argv)

    if args.command == "status":
        return status()
    if args.command == "diff":
        return diff(args.source_root, args.torch_version, args.output_dir)
    if args.command == "patches":
        return patches(args.directory, args.release, args.wheels)
    if args.command == "docs":
        return docs(args.doc, args.readme, args.survey, args.check)
    if args.command == "run":
        return run(args.target)
    if args.command == "watch":
        from .doctor import watch

        target = args.target[1:] if args.target[:1] == ["--"] else args.target
        return watch.main(target, args.interval, args.json)
    if args.command == "pth":
        return pth(args.action, args.site_dir)
    if args.command == "stress":
        return stress.main(args)
    return doctor(selftest=not getattr(args, "no_selftest", False))


if __name__ == "__main__":
    sys.exit(main())
