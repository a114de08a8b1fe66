"""Whether the service of a `pdserve systemd-unit` unit can read what it runs, under that unit's own sandbox:
PrivateTmp=yes gives it an empty /tmp and /var/tmp, and DynamicUser=yes runs it as a user that owns nothing and
is in no group, so it reads only what every user may (a mode-0700 home is closed to it)."""
from __future__ import annotations

import os
import pwd
import stat
import sys
import sysconfig
from pathlib import Path

PRIVATE_TMP_DIRS = (Path("/tmp"), Path("/var/tmp"))
READ, EXECUTE = 4, 1


def service_paths(model: str | None) -> dict[str, Path]:
    """What the service reads, by what it is: the interpreter, its environment, pdserve's code, the installed
    packages and a model given as a path."""
    paths = {"the interpreter": Path(sys.executable), "its Python environment": Path(sys.prefix),
             "pdserve's code": Path(__file__).resolve().parent.parent,
             "the installed packages": Path(sysconfig.get_paths()["purelib"])}
    if model and Path(model).expanduser().exists():
        paths["the model"] = Path(model).expanduser().absolute()
    return paths


def unreadable(paths: dict[str, Path], user: str | None, private_tmp: bool) -> str | None:
    """Why the service cannot read one of `paths`, with the fix; None when it can read them all (or `user` is not
    known on this machine, so nothing can be told)."""
    for what, path in paths.items():
        for candidate in dict.fromkeys((path.absolute(), path.resolve())):
            hidden = next((d for d in PRIVATE_TMP_DIRS if candidate.is_relative_to(d)), None)
            if private_tmp and hidden is not None:
                return (f"{what} {candidate} lies in {hidden}, which the unit's PrivateTmp=yes hides from the service "
                        f"(it gets an empty {hidden}): install pdserve and the model outside {hidden}, e.g. in a "
                        "virtualenv under /opt/pdserve, and run this command with that environment's python")
            closed = _closed_directory(candidate, user)
            if closed is not None:
                return _permission_problem(what, candidate, closed, user)
    return None


def _closed_directory(path: Path, user: str | None) -> Path | None:
    """The first of `path` and its parents that the service cannot pass (or read, for `path` itself)."""
    identity = _identity(user)
    if identity is None or identity[0] == 0:
        return None
    chain = [*reversed(path.parents), path]
    for index, step in enumerate(chain):
        try:
            info = step.stat()
        except OSError:
            return None                          # not there: nothing to tell
        last = index == len(chain) - 1
        wanted = (READ | EXECUTE if stat.S_ISDIR(info.st_mode) else READ) if last else EXECUTE
        if _bits(info, identity) & wanted != wanted:
            return step
    return None


def _identity(user: str | None) -> tuple[int, frozenset[int]] | None:
    """(uid, gids) of `user`; DynamicUser's (a uid nothing belongs to, no group) for None; None when unknown."""
    if user is None:
        return -1, frozenset()
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return None
    return entry.pw_uid, frozenset(os.getgrouplist(user, entry.pw_gid))


def _bits(info: os.stat_result, identity: tuple[int, frozenset[int]]) -> int:
    uid, gids = identity
    if info.st_uid == uid:
        return (info.st_mode >> 6) & 7
    if info.st_gid in gids:
        return (info.st_mode >> 3) & 7
    return info.st_mode & 7


def _permission_problem(what: str, path: Path, closed: Path, user: str | None) -> str:
    mode = f"{stat.S_IMODE(closed.stat().st_mode):04o}"
    owner = _owner(closed)
    who = f"the service user {user}" if user else "the service's dynamic user (DynamicUser=yes)"
    return (f"{who} cannot read {what} {path}: {closed} is mode {mode} (owner {owner}); pass --unit-user {owner}, "
            "or install pdserve and the model where that user can read them, e.g. a virtualenv under /opt/pdserve")


def _owner(path: Path) -> str:
    uid = path.stat().st_uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)

