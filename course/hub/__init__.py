"""A class on one server: JupyterHub with the course's workspaces, nbgrader's exchange and the students' progress.

``ddp-course hub start --roster roster.csv`` (:mod:`course.hub.command`) makes everything a class needs on this
machine and then becomes the hub:

- :mod:`course.hub.roster`: the roster file, and one Linux account per person on it (students and instructors),
  each with a home only its owner can enter and a password the hub generates (PAM checks it at login);
- :mod:`course.hub.layout`: the class folder: the student edition every workspace is made from (student copies
  only), the instructors' nbgrader course, the exchange with one inbound folder per student, the hub's state
  and secrets (generated, readable by root only), and the Jupyter settings of each role;
- :mod:`course.hub.exchange`: nbgrader's filesystem exchange, kept from what its default lets students do to
  each other (read another's submission, submit under another's name);
- :mod:`course.hub.singleuser`: what each person's server runs first, as them: their workspace, made or brought
  up to date, then JupyterHub's single-user server on it;
- :mod:`course.progress`: what a student ran and passed (recorded by their own kernels), and
  :mod:`course.hub.service`: the page that shows it to them, and the whole class to instructors.
"""
