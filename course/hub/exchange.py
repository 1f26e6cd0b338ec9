"""nbgrader's filesystem exchange for a class on one server, without what its default lets students do to each other.

nbgrader's default exchange (``nbgrader.exchange.default``) keeps every submission in one ``inbound/`` folder
that every user may write, named ``<student>+<assignment>+<time>+<random>``, and ``collect`` files a submission
under the student its *name* gives (an owner that differs is only logged). So a student can submit under
another's name (the newest submission wins) and, with a name, read or change another's submission (nbgrader
discussion #1862, issue #659). Here every student has their own inbound folder, ``inbound/<student>/``, that
only they (its owner) and the instructors (its group) can enter, made by the class (:mod:`course.hub.layout`),
never by nbgrader:

- :class:`ExchangeSubmit` writes to the submitting user's own folder, under their own name only (``--student``
  naming someone else is refused);
- :class:`ExchangeCollect` reads each student's folder and files a submission under the folder's student only
  when its name says the same student and its owner is that student's account: anything else is refused and
  named (never filed);
- :class:`ExchangeList` lists the per-student folders; the other steps differ from nbgrader's only in that the
  exchange's root need not be writable by everyone (:class:`_ClassExchange`).

Released assignments (``outbound/``) are readable by all, as nbgrader's are; feedback pages keep nbgrader's
names (a hash keyed by a secret in the submission, which only its student and the instructors can read).
The nbgrader config of each role names these classes (:mod:`course.hub.layout`).
"""

from __future__ import annotations

import base64
import glob
import os
import pwd
import re
from collections import defaultdict

from nbgrader.api import Gradebook, MissingEntry
from nbgrader.exchange import default
from nbgrader.utils import check_directory, check_mode, get_username
from traitlets import Bool

INBOUND = "inbound"


def inbound_folder(root: str, course_id: str, student: str) -> str:
    """A student's own inbound folder in the exchange at ``root``."""
    return os.path.join(root, course_id, INBOUND, student)


class _ClassExchange:
    """The class's exchange root is owned by root and not writable by its users: reaching it is enough."""

    def ensure_root(self):
        if not check_directory(self.root, execute=True):
            self.fail(f"The exchange {self.root} cannot be reached: ask your instructor (is your account on the "
                      "class roster?)")


class ExchangeFetchAssignment(_ClassExchange, default.ExchangeFetchAssignment):
    pass


class ExchangeFetchFeedback(_ClassExchange, default.ExchangeFetchFeedback):
    pass


class ExchangeReleaseAssignment(_ClassExchange, default.ExchangeReleaseAssignment):
    pass


class ExchangeReleaseFeedback(_ClassExchange, default.ExchangeReleaseFeedback):
    pass


class ExchangeSubmit(_ClassExchange, default.ExchangeSubmit):
    """Submit into the user's own inbound folder, under their own name."""

    def init_dest(self):
        if self.coursedir.course_id == "":
            self.fail("No course id specified. Re-run with --course flag.")
        if not self.authenticator.has_access(self.coursedir.student_id, self.coursedir.course_id):
            self.fail("You do not have access to this course.")
        me = get_username()
        if self.coursedir.student_id not in ("*", "", me):
            self.fail(f"You can submit as yourself ({me}) only, not as {self.coursedir.student_id!r}.")
        self.inbound_path = inbound_folder(self.root, self.coursedir.course_id, me)
        if not os.path.isdir(self.inbound_path):
            self.fail(f"You have no inbound folder in this course ({self.inbound_path}): ask your instructor to "
                      "add you to the class roster.")
        if not check_mode(self.inbound_path, write=True, execute=True):
            self.fail(f"You cannot write to your inbound folder {self.inbound_path}: ask your instructor.")
        self.cache_path = os.path.join(self.cache, self.coursedir.course_id)
        name = f"{me}+{self.coursedir.assignment_id}+{self.timestamp}"
        if self.add_random_string:
            name += "+" + base64.urlsafe_b64encode(os.urandom(9)).decode("ascii")
        self.assignment_filename = name


def submission_problem(folder_student: str, path: str, username: str, check_owner: bool = True) -> str | None:
    """Why the submission at ``path``, found in ``folder_student``'s inbound folder under the name ``username``,
    must not be filed (None when it may be). ``check_owner``: the folder's student has a Linux account here,
    which must own the submission (on Kubernetes every pod runs as one uid: a student's pod mounts only their
    own inbound folder, and that is the check)."""
    if username != folder_student:
        return f"it is named for {username!r} but lies in {folder_student!r}'s inbound folder"
    if os.path.islink(path) or not os.path.isdir(path):
        return "it is not a folder"
    if not check_owner:
        return None
    try:
        uid = pwd.getpwnam(folder_student).pw_uid
    except KeyError:
        return f"there is no account {folder_student!r} on this machine"
    try:
        st = os.lstat(path)
    except OSError as err:
        return f"it cannot be read ({err.strerror})"
    if st.st_uid != uid:
        try:
            owner = pwd.getpwuid(st.st_uid).pw_name
        except KeyError:
            owner = f"uid {st.st_uid}"
        return f"it belongs to {owner}, not to {folder_student}"
    return None


class ExchangeCollect(_ClassExchange, default.ExchangeCollect):
    """Collect from each student's own inbound folder; a submission is filed under that folder's student only."""

    owner_is_student = Bool(True, help="Refuse a submission its folder's student's Linux account does not own "
                                       "(off on Kubernetes, where every pod runs as one uid and a student's pod "
                                       "mounts their own inbound folder only)").tag(config=True)

    def init_src(self):
        if self.coursedir.course_id == "":
            self.fail("No course id specified. Re-run with --course flag.")
        self.course_path = os.path.join(self.root, self.coursedir.course_id)
        self.inbound_path = os.path.join(self.course_path, INBOUND)
        if not os.path.isdir(self.inbound_path):
            self.fail(f"Course not found: {self.inbound_path}")
        if not check_mode(self.inbound_path, read=True, execute=True):
            self.fail(f"You don't have read permissions for the directory: {self.inbound_path}")
        student = self.coursedir.student_id or "*"
        pattern = os.path.join(self.inbound_path, student, f"*+{self.coursedir.assignment_id}+*")
        records = []
        #: (path, why) of every submission found and not filed
        self.refused = []
        for path in sorted(glob.glob(pattern)):
            folder = os.path.basename(os.path.dirname(path))
            record = self._path_to_record(path)
            why = submission_problem(folder, path, record["username"], self.owner_is_student)
            if why:
                self.refused.append((path, why))
                self.log.error(f"Not collected: {path}: {why}")
                continue
            record["filename"] = os.path.join(folder, record["filename"])
            records.append(record)
        usergroups = defaultdict(list)
        for record in records:
            usergroups[record["username"]].append(record)
        with Gradebook(self.coursedir.db_url, self.coursedir.course_id) as gb:
            try:
                self.duedate = gb.find_assignment(self.coursedir.assignment_id).duedate
            except MissingEntry:
                self.duedate = None
        self.src_records = []
        for group in usergroups.values():
            group = self._sort_by_timestamp(group)
            if self.duedate is not None and self.before_duedate:
                on_time = [r for r in group if r["timestamp"] <= self.duedate]
                group = on_time or group
            self.src_records.append(group[0])


class ExchangeList(_ClassExchange, default.ExchangeList):
    """List released assignments as nbgrader does; submissions (``--inbound``) from the per-student folders."""

    def init_dest(self):
        if not self.inbound:
            return super().init_dest()
        course_id = self.coursedir.course_id or "*"
        assignment_id = self.coursedir.assignment_id or "*"
        student_id = self.coursedir.student_id or "*"
        pattern = os.path.join(self.root, course_id, INBOUND, student_id, f"{student_id}+{assignment_id}+*")
        self.assignments = sorted(glob.glob(pattern))

    def parse_assignment(self, assignment):
        if not self.inbound:
            return super().parse_assignment(assignment)
        regexp = (r".*/(?P<course_id>[^/]*)/inbound/(?P<folder>[^/]*)/(?P<student_id>[^+/]*)\+"
                  r"(?P<assignment_id>[^+]*)\+(?P<timestamp>[^+]*)(?P<random_string>\+.*)?")
        m = re.match(regexp, assignment)
        if m is None:
            raise RuntimeError(f"Could not match {assignment!r} with {regexp!r}")
        info = m.groupdict()
        info.pop("folder")
        return info


#: ExchangeFactory's settings naming these classes (the class's nbgrader config, both roles)
FACTORY = {
    "fetch_assignment": ExchangeFetchAssignment,
    "fetch_feedback": ExchangeFetchFeedback,
    "release_assignment": ExchangeReleaseAssignment,
    "release_feedback": ExchangeReleaseFeedback,
    "submit": ExchangeSubmit,
    "collect": ExchangeCollect,
    "list": ExchangeList,
}


def factory_config_lines() -> list[str]:
    """``c.ExchangeFactory.<step> = "course.hub.exchange.<Class>"`` for every step."""
    return [f'c.ExchangeFactory.{step} = "{__name__}.{cls.__name__}"' for step, cls in FACTORY.items()]
