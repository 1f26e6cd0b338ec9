"""Late work on nbgrader: due dates, a late policy and extensions, all kept where nbgrader keeps them.

* A due date is nbgrader's own ``Assignment.duedate`` (naive UTC) in the gradebook; an extension is
  ``Submission.extension``; nbgrader's autograde reads the submission's ``timestamp.txt`` (``collect`` writes
  it) and computes ``total_seconds_late`` from all three.
* The penalty is asked of :class:`~course.instructor.latepolicy.LatePolicy`, the late-submission plugin the
  course's ``nbgrader_config.py`` names for nbgrader's ``AssignLatePenalties`` (``ddp-course init`` writes
  that block; ``ddp-course duedate --penalty`` rewrites it), so plain ``nbgrader autograde`` applies the same
  policy. It lives in its own module because it imports nbgrader (seconds): this one does not.

The policy: ``penalty`` percent of a notebook's points for every hour or day late that has begun (``per``),
at most ``cap`` percent; 0 marks late work without a penalty. nbgrader itself keeps a penalty within the
notebook's score.
"""

from __future__ import annotations

import math
import os
import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

from course.errors import CourseError

#: the lines of nbgrader_config.py that hold the policy (rewritten between these markers)
BLOCK_BEGIN = "# >>> late work (ddp-course duedate --penalty/--cap rewrites this block)"
BLOCK_END = "# <<< late work"


def course_policy(config):
    """The :class:`~course.instructor.latepolicy.LatePolicy` a course's config sets, or None where its
    AssignLatePenalties does not use it
    (a config written before late policies: ``ddp-course duedate --penalty`` adds the block)."""
    plugin = config.AssignLatePenalties.get("plugin_class")
    name = plugin.rsplit(".", 1)[-1] if isinstance(plugin, str) else getattr(plugin, "__name__", None)
    if name != "LatePolicy":
        return None
    from course.instructor.latepolicy import LatePolicy

    return LatePolicy(config=config)


def policy_block(penalty: float = 0.0, per: str = "day", cap: float = 100.0) -> str:
    """The lines of nbgrader_config.py that set the late policy."""
    return (f"{BLOCK_BEGIN}\n"
            "# nbgrader's AssignLatePenalties asks LatePolicy for each late notebook's penalty: `penalty` percent of\n"
            "# the notebook's points per started `per` (\"hour\" or \"day\") after the due date and any extension,\n"
            "# at most `cap` percent; penalty 0 marks late work without a penalty.\n"
            "from course.instructor.latepolicy import LatePolicy  # noqa: E402\n\n"
            "c.AssignLatePenalties.plugin_class = LatePolicy\n"
            f"c.LatePolicy.penalty = {float(penalty)!r}\n"
            f"c.LatePolicy.per = {per!r}\n"
            f"c.LatePolicy.cap = {float(cap)!r}\n"
            f"{BLOCK_END}\n")


def write_policy(config_path: Path, penalty: float, per: str, cap: float) -> None:
    """Rewrite the policy block of ``config_path`` (appended where there is none); atomic, the rest kept."""
    try:
        text = config_path.read_text()
    except OSError as err:
        raise CourseError(f"cannot read {config_path}: {err.strerror or err}") from None
    block = policy_block(penalty, per, cap)
    pattern = re.compile(re.escape(BLOCK_BEGIN) + r".*?" + re.escape(BLOCK_END) + r"\n?", re.S)
    text = pattern.sub(lambda _: block, text, count=1) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    tmp = config_path.with_name(f".{config_path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, config_path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise CourseError(f"cannot write {config_path}: {err.strerror or err} (the policy is unchanged)") from None


_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%?\s*(?:/|per\s+)\s*(hour|day|h|d)\s*$", re.I)


def parse_rate(text: str) -> tuple[float, str]:
    """``"10%/day"``, ``"5/hour"``, ``"none"`` -> (percent, unit)."""
    if text.strip().lower() in ("none", "0", "off"):
        return 0.0, "day"
    match = _RATE.match(text)
    if not match:
        raise CourseError(f"--penalty {text!r}: write PERCENT/hour or PERCENT/day (10%/day), or none")
    unit = {"h": "hour", "d": "day"}.get(match[2].lower(), match[2].lower())
    return float(match[1]), unit


def parse_percent(text: str, what: str) -> float:
    match = re.match(r"^\s*(\d+(?:\.\d+)?)\s*%?\s*$", text)
    if not match or float(match[1]) > 100:
        raise CourseError(f"{what} {text!r}: a percent from 0 to 100 (50%)")
    return float(match[1])


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(w|d|h|m)", re.I)


def parse_duration(text: str) -> timedelta | None:
    """``"2d"``, ``"36h"``, ``"1d12h"``, ``"90m"`` -> a timedelta; ``"0"`` or ``"none"`` -> None (no extension)."""
    if text.strip().lower() in ("0", "none"):
        return None
    parts = _DURATION.findall(text)
    if not parts or _DURATION.sub("", text).strip():
        raise CourseError(f"extension {text!r}: write a length such as 2d, 36h, 1d12h or 90m (0 removes it)")
    unit = {"w": "weeks", "d": "days", "h": "hours", "m": "minutes"}
    total = timedelta()
    for number, letter in parts:
        total += timedelta(**{unit[letter.lower()]: float(number)})
    return total


def parse_when(text: str, tz: str | None) -> datetime:
    """A due date as nbgrader stores it (naive UTC) from ``"2026-12-01 17:00"`` in ``tz`` (an IANA name;
    default: this machine's time zone) or with its own offset (``"2026-12-01T17:00+01:00"``)."""
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise CourseError(f"due date {text!r}: write YYYY-MM-DD HH:MM (24-hour clock), e.g. \"2026-12-01 17:00\"") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=zone(tz)) if tz else when.astimezone()
    elif tz:
        raise CourseError(f"due date {text!r} carries its own offset: drop --tz {tz}")
    return when.astimezone(timezone.utc).replace(tzinfo=None)


def zone(name: str):
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise CourseError(f"--tz {name!r}: not a time zone name (an IANA name such as Europe/Berlin, "
                          "America/New_York or UTC)") from None


def shown(when: datetime | None) -> str:
    """A naive-UTC gradebook time as ``2026-12-01 16:00 UTC``."""
    return when.strftime("%Y-%m-%d %H:%M UTC") if when else "-"


def late_by(seconds: float) -> str:
    """``3 h 20 min`` / ``2 d 4 h`` for a number of seconds late."""
    minutes = math.ceil(seconds / 60)
    days, rest = divmod(minutes, 1440)
    hours, minutes = divmod(rest, 60)
    if days:
        return f"{days} d {hours} h" if hours else f"{days} d"
    return f"{hours} h {minutes} min" if hours else f"{minutes} min"
