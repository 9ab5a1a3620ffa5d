"""Building a C++ extension into the kernel cache, one builder at a time.

The CPU attention kernel (cpu.py) and the benchmarks' paged read pass (benchmarks/paged_read.py)
build through here: torch's `cpp_extension.load` under an flock on the build directory, so that
concurrent first uses wait for one build, and a builder killed midway cannot hang the next.
"""

from __future__ import annotations

import fcntl
from pathlib import Path
from types import ModuleType
from typing import IO

_LDFLAGS = ("-fopenmp",)  # a tuple: torch appends its libraries to the lists it is given


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
