"""Building a C++ extension into the kernel cache, one builder at a time.

The CPU attention kernel (cpu.py) and the benchmarks' paged read pass (benchmarks/paged_read.py)
build through here: torch's `cpp_extension.load` under an flock on the build directory, so that
concurrent first uses wait for one build, and a builder killed midway cannot hang the next; each
in a directory named by `build_key`, so a rebuild happens only when what it depends on changes.
"""

from __future__ import annotations

import fcntl
import hashlib
import platform
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import IO

import torch

# -Wno-psabi: GCC notes the ABI of wide vector returns; they never leave the files.
# Tuples: torch appends its own libraries to the flag lists it is given, and a module-level list
# that grew would change the build's hash, so every later load in the process would rebuild.
BASE_CFLAGS = ("-O3", "-fopenmp", "-Wno-psabi")
_LDFLAGS = ("-fopenmp",)


def build_key(files: Iterable[Path], *parts: str) -> str:
    """What a built extension depends on: its source files, the torch install, `parts` (the ISA,
    the flags) and the host's CPU features; a change to any of it builds a fresh copy."""
    digest = hashlib.sha256()
    for part in (
        *(file.read_bytes() for file in files),
        torch.__version__.encode(),
        # Each torch install writes its own include paths into build.ninja: two venvs sharing one
        # build directory would rebuild it back and forth.
        str(Path(torch.__file__).parent).encode(),
        *(part.encode() for part in parts),
        _host_cpu_signature().encode(),
    ):
        digest.update(part)
    return digest.hexdigest()[:12]


def _host_cpu_signature() -> str:
    # -march=native output is only valid on CPUs with the same features: key the build on them.
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith("flags")), platform.machine())
    except OSError:
        return platform.processor() or platform.machine()


def build_extension(
    name: str, sources: tuple[Path, ...], cflags: list[str], build_dir: Path, what: str
) -> ModuleType:
    """Build (unless `build_dir` holds it) and import the C++ extension `name` from `sources`;
    `what` names it in the error.

    Raises:
        RuntimeError: the directory is not writable, or the compiler or torch's build tooling
            failed (with the build log).
    """
    from torch.utils import cpp_extension

    flock = _open_build_lock(build_dir)
    # torch's own build lock is a plain file that a killed builder leaves behind, after which every
    # later start waits forever. An flock dies with its holder: whoever holds it is the only
    # builder alive, so a torch lock file found then is stale and is removed.
    with flock:
        fcntl.flock(flock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        try:
            return cpp_extension.load(
                name=name,
                sources=[str(source) for source in sources],
                extra_cflags=cflags,
                extra_ldflags=list(_LDFLAGS),
                build_directory=str(build_dir),
                verbose=False,
            )
        except Exception as error:  # compiler errors surface as several exception types
            raise RuntimeError(f"building {what} in {build_dir} failed: {error}") from error


def _open_build_lock(build_dir: Path) -> IO[str]:
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        return open(build_dir / "pagedserve.flock", "w")  # noqa: SIM115 - the caller closes it
    except OSError as error:  # e.g. a cache directory owned by another user
        raise RuntimeError(
            f"cannot use the kernel cache {build_dir} ({error}); point "
            "$PAGEDSERVE_CACHE at a writable directory"
        ) from error
