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

from course.progress import page_html, read_record, student_html, summary


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
    return page_html("Class progress", table)


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
