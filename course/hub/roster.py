"""The class roster, and one Linux account per person on it.

A roster is a CSV file with a header: ``username,role`` and optionally ``name`` (a display name)::

    username,role,name
    ada,student,Ada Lovelace
    grace,instructor,Grace Hopper

Usernames become Linux accounts (and nbgrader student ids), so they follow the rules of both: a lower-case
letter first, then lower-case letters, digits, ``_`` or ``-``, at most 32 characters. Roles are ``student`` and
``instructor``. :func:`ensure_accounts` makes the accounts this machine lacks (with ``useradd``), each home
readable by its owner only, puts instructors in the class's instructor group, and gives every new account a
generated password (``chpasswd``), listed for the instructor in a file only root can read.
"""

from __future__ import annotations

import csv
import grp
import json
import os
import pwd
import re
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from course.errors import CourseError
from course.instructor.coursedir import write_whole

ROLES = ("student", "instructor")
USERNAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
#: accounts a roster may not name: they exist on every machine and are not people
RESERVED = {"root", "daemon", "bin", "sys", "sync", "games", "man", "lp", "mail", "news", "uucp", "proxy",
            "www-data", "backup", "list", "irc", "nobody", "sshd", "postgres", "slurm", "munge", "admin",
            "jovyan", "learner"}


class RosterError(CourseError):
    """The roster cannot be used as it is (one line per problem, each naming its line)."""


@dataclass(frozen=True)
class Member:
    username: str
    role: str
    name: str = ""

    @property
    def instructor(self) -> bool:
        return self.role == "instructor"


def read_roster(path: Path) -> list[Member]:
    """The members listed in ``path``; raises :class:`RosterError` naming every bad line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except OSError as err:
        raise RosterError(f"cannot read the roster {path}: {err.strerror or err}") from None
    rows = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(rows)
    fields = [f.strip().lower() for f in (reader.fieldnames or [])]
    if "username" not in fields or "role" not in fields:
        raise RosterError(f"{path}: the first line must name the columns, at least username,role "
                          f"(got {','.join(fields) or 'nothing'})")
    reader.fieldnames = fields
    members, problems, seen = [], [], {}
    for number, row in enumerate(reader, start=2):
        username = (row.get("username") or "").strip()
        role = (row.get("role") or "").strip().lower()
        name = (row.get("name") or "").strip()
        where = f"{path}, row {number - 1} ({username or 'no username'})"
        if not USERNAME.fullmatch(username):
            problems.append(f"{where}: a username is a lower-case letter, then lower-case letters, digits, _ "
                            "or -, at most 32 characters (it becomes a Linux account and an nbgrader id)")
        elif username in RESERVED:
            problems.append(f"{where}: {username!r} is a system account, not a person: choose another name")
        elif username in seen:
            problems.append(f"{where}: {username!r} is listed twice (first in row {seen[username]})")
        if any(ch in name for ch in ":,\\") or any(ord(ch) < 32 for ch in name) or len(name) > 100:
            problems.append(f"{where}: a name holds no ':', ',', backslash or control character and at most 100 "
                            "characters (it becomes the account's comment)")
        if role not in ROLES:
            problems.append(f"{where}: role must be student or instructor, got {role or 'nothing'!r}")
        seen.setdefault(username, number - 1)
        members.append(Member(username, role, name))
    if problems:
        raise RosterError("the roster has problems:\n" + "\n".join(f"  {p}" for p in problems))
    if not members:
        raise RosterError(f"{path} lists nobody")
    if not any(m.instructor for m in members):
        raise RosterError(f"{path} lists no instructor: who would release and grade? Add a row with role "
                          "instructor")
    return members


# --------------------------------------------------------------------------- Linux accounts


def _run(argv: list[str], stdin: str | None = None) -> None:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True)
    if result.returncode:
        raise CourseError(f"{' '.join(argv[:1])} failed ({result.returncode}): "
                          f"{(result.stderr or result.stdout).strip()}")


def ensure_group(name: str) -> int:
    """The gid of group ``name``, made when it does not exist."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        _run(["groupadd", name])
        return grp.getgrnam(name).gr_gid


def account_exists(username: str) -> bool:
    try:
        pwd.getpwnam(username)
    except KeyError:
        return False
    return True


@dataclass
class Accounts:
    """What :func:`ensure_accounts` did."""

    made: list[str]
    kept: list[str]
    #: username -> the password given to an account made now (written to the passwords file too)
    passwords: dict[str, str]
    #: accounts made again as they were saved (same uid, same password)
    restored: list[str] = field(default_factory=list)


def _shadow_hashes() -> dict[str, str]:
    """Every account's password hash as /etc/shadow holds it."""
    hashes = {}
    for line in Path("/etc/shadow").read_text().splitlines():
        name, _, rest = line.partition(":")
        hashes[name] = rest.split(":", 1)[0]
    return hashes


def _shadow_hash(username: str) -> str:
    """``username``'s password hash ("" when there is none)."""
    return _shadow_hashes().get(username, "")


def _read_saved(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def ensure_accounts(members: list[Member], instructor_group: str, passwords_file: Path,
                    saved_file: Path | None = None) -> Accounts:
    """Make the accounts of ``members`` this machine lacks and set each one up for the class (root only).

    A new account gets a home only it can enter and a generated password (appended to ``passwords_file``,
    mode 0600); an account that exists keeps its password and its files. Every home is made private (mode 0700:
    a student's workspace is theirs alone), and instructors (only they) are in ``instructor_group``.

    ``saved_file`` (root only) keeps each account's uid, gid and password hash: an account this machine lost
    while its home and the class folder stayed (a container made anew from its image, the homes and the class
    on volumes) is made again as it was, same uid (its files stay its own), same password.
    """
    if os.geteuid() != 0:
        raise CourseError("making the class's accounts needs root: run `ddp-course hub start` as root (the hub "
                          "starts each person's server as their own Linux user)")
    gid = ensure_group(instructor_group)
    saved = _read_saved(saved_file) if saved_file else {}
    made, kept, restored, passwords = [], [], [], {}
    for member in members:
        name = member.username
        if account_exists(name):
            kept.append(name)
        elif isinstance(saved.get(name), dict) and {"uid", "gid", "hash"} <= set(saved[name]):
            entry = saved[name]
            try:
                grp.getgrgid(int(entry["gid"]))
            except KeyError:
                _run(["groupadd", "--gid", str(int(entry["gid"])), name])
            _run(["useradd", "--create-home", "--uid", str(int(entry["uid"])), "--gid", str(int(entry["gid"])),
                  "--shell", "/bin/bash", "--comment", member.name or name, "--password", str(entry["hash"]), name])
            restored.append(name)
        else:
            _run(["useradd", "--create-home", "--user-group", "--shell", "/bin/bash",
                  "--comment", member.name or name, name])
            password = secrets.token_urlsafe(12)
            _run(["chpasswd"], stdin=f"{name}:{password}\n")
            passwords[name] = password
            made.append(name)
        entry = pwd.getpwnam(name)
        saved[name] = {"uid": entry.pw_uid, "gid": entry.pw_gid}
        home = Path(entry.pw_dir)
        if home.is_dir():
            os.chmod(home, 0o700)
        in_group = name in grp.getgrgid(gid).gr_mem
        if member.instructor and not in_group:
            _run(["gpasswd", "--add", name, instructor_group])
        elif not member.instructor and in_group:  # a former instructor listed as a student now
            _run(["gpasswd", "--delete", name, instructor_group])
    if passwords:
        _append_private(passwords_file, "username,password\n",
                        [f"{name},{password}\n" for name, password in passwords.items()])
    hashes = _shadow_hashes()  # read once, after every account is made
    for member in members:
        saved[member.username]["hash"] = hashes.get(member.username, "")
    if saved_file:
        write_whole(saved_file, json.dumps(saved, indent=1), mode=0o600)
    return Accounts(made, kept, passwords, restored)


def _append_private(path: Path, header: str, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "a") as out:
        if out.tell() == 0:
            out.write(header)
        out.writelines(lines)
    os.chmod(path, 0o600)


def set_password(username: str, password: str) -> None:
    """Give ``username`` a new password (root only)."""
    _run(["chpasswd"], stdin=f"{username}:{password}\n")
