"""The class server's progress page, a JupyterHub service: ``/services/progress/``.

A student who opens it (from the hub's Services menu, logged in through the hub) sees their own record
(:mod:`course.progress`): the lessons they ran to the end, each check's last result and tries, the hints
they asked for. An instructor sees the class: one row per student (lessons finished, test cells passing and
failing, hints, the check they failed most often without passing it since, last activity), each row opening
that student's record; ``?format=json`` gives the same as JSON. A student asking for another's record is
refused (403). Roles come from the roster the hub was started with (a file only root reads).
"""

from __future__ import annotations

import argparse
import html
import json
import os
from pathlib import Path
from urllib.parse import urlparse

from course.progress import read_record, summary

STYLE = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse}"
         "td,th{border:1px solid #ccc;padding:.3em .6em;text-align:left;vertical-align:top}"
         ".pass{color:#1a7f37}.fail{color:#cf222e}")


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>{body}</body></html>")


def lessons_html(record: dict, lessons: list[str]) -> str:
    e = html.escape
    items = []
    for lesson in lessons:
        entry = record.get(lesson, {})
        if entry.get("finished"):
            state = "<span class=pass>run to the end</span>"
        elif entry.get("ran"):
            state = f"{entry['ran']} of {entry.get('cells', '?')} code cells run"
        else:
            state = "not started"
        items.append(f"<li>{e(lesson)}: {state}</li>")
    return f"<h2>Lessons</h2><ul>{''.join(items)}</ul>" if items else ""


def student_html(username: str, record: dict, lessons: list[str] = ()) -> str:
    e = html.escape
    intro = lessons_html(record, list(lessons))
    if not record:
        return _page(f"Progress of {username}",
                     intro + "<p>Nothing recorded yet: run a lesson or a check in your lab.</p>")
    rows = []
    for notebook, entry in sorted(record.items()):
        parts = []
        if "cells" in entry:
            state = "run to the end" if entry.get("finished") else f"{entry.get('ran', 0)} of {entry['cells']} cells run"
            parts.append(e(state))
        for grade_id, test in sorted(entry.get("tests", {}).items()):
            mark = "<span class=pass>passed</span>" if test["passed"] else "<span class=fail>failed</span>"
            detail = "" if test["passed"] else f": {e(test['check'])} {e(test['message'])}"
            parts.append(f"{e(grade_id)} {mark}{detail} ({test['tries']} tries)")
        hints = entry.get("hints", [])
        if hints:
            parts.append(f"{len(hints)} hint(s) asked: " + e(", ".join(sorted({h['check'] for h in hints}))))
        rows.append(f"<tr><td>{e(notebook)}</td><td>{'<br>'.join(parts)}</td><td>{e(entry.get('updated', ''))}</td></tr>")
    table = "<table><tr><th>notebook</th><th>what ran</th><th>last change</th></tr>" + "".join(rows) + "</table>"
    return _page(f"Progress of {username}", intro + "<h2>Notebooks</h2>" + table)


def class_html(students: dict[str, dict], lessons: int = 0) -> str:
    e = html.escape
    rows = []
    for name, info in sorted(students.items()):
        stuck = info["stuck"]
        where = "" if stuck is None else (f"{e(stuck['notebook'])} {e(stuck['cell'])}: {e(stuck['check'])} "
                                          f"({stuck['failures']} failures)")
        rows.append(f"<tr><td><a href='?student={e(name)}'>{e(name)}</a></td>"
                    f"<td>{len(info['lessons'])}{f' of {lessons}' if lessons else ''}</td>"
                    f"<td class=pass>{info['passing']}</td><td class=fail>{info['failing']}</td>"
                    f"<td>{info['hints']}</td><td>{where}</td><td>{e(info['last'])}</td></tr>")
    table = ("<table><tr><th>student</th><th>lessons run to the end</th><th>test cells passing</th>"
             "<th>failing</th><th>hints</th><th>stuck at</th><th>last activity</th></tr>" + "".join(rows) + "</table>")
    return _page("Class progress", table)


def edition_lessons(edition: Path | None) -> list[str]:
    """The lessons students get ("lessons/01-....ipynb"), from the class's edition."""
    if edition is None or not (edition / "lessons").is_dir():
        return []
    return sorted(f"lessons/{p.name}" for p in (edition / "lessons").glob("*.ipynb"))


def make_app(roles: dict[str, str], prefix: str, lessons: list[str] = ()):
    from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
    from tornado import web

    class ProgressHandler(HubOAuthenticated, web.RequestHandler):
        @web.authenticated
        def get(self):
            me = self.get_current_user()["name"]
            wanted = self.get_argument("student", None)
            as_json = self.get_argument("format", "") == "json"
            instructor = roles.get(me) == "instructor"
            if wanted is not None and wanted != me and not instructor:
                raise web.HTTPError(403, "you may see your own progress only")
            if instructor and wanted is None:
                students = {name: summary(read_record(name)) for name, role in roles.items() if role == "student"}
                if as_json:
                    return self.finish({"students": students})
                return self.finish(class_html(students, len(lessons)))
            name = wanted or me
            if name not in roles:
                raise web.HTTPError(404, "no such student in this class")
            record = read_record(name)
            if as_json:
                return self.finish({"student": name, "notebooks": record, "summary": summary(record)})
            self.finish(student_html(name, record, lessons))

    return web.Application([
        (prefix, ProgressHandler),
        (prefix + "oauth_callback", HubOAuthCallbackHandler),
    ], cookie_secret=os.urandom(32))


def main(argv: list[str] | None = None) -> None:
    from tornado.ioloop import IOLoop

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roster", required=True, type=Path, help="the hub's roles file (username -> role)")
    parser.add_argument("--edition", type=Path, default=None, help="the class's edition (its lessons are listed)")
    args = parser.parse_args(argv)
    roles = json.loads(args.roster.read_text())
    url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    app = make_app(roles, os.environ["JUPYTERHUB_SERVICE_PREFIX"], edition_lessons(args.edition))
    app.listen(url.port, url.hostname)
    IOLoop.current().start()


if __name__ == "__main__":  # pragma: no cover - the hub starts it
    main()
