"""The environment variables that cross packages, named once (bottom layer: imports nothing).

A variable set by one package and read by another (the launcher's ranks, the sandbox's
processes, the check packages) is spelled here, so neither imports the other for a name.
"""

#: the backend the launcher chose for a job's ranks (see :func:`course.launcher.backend`)
BACKEND_ENV = "DDP_COURSE_BACKEND"
#: "1" in sandboxed grading processes: no check runs there (see :func:`course.launcher.warm_up`)
GRADING_ENV = "DDP_COURSE_GRADING"
#: the cores this process's jobs share (see :func:`course.launcher.cpus`)
CPUS_ENV = "DDP_COURSE_CPUS"
#: marker of every sandboxed process (used to find strays when not root)
TOKEN_ENV = "DDP_COURSE_SANDBOX"
#: "0": no early deadlock detection in the launcher (every hang waits for the job's deadline)
STALLS_ENV = "DDP_COURSE_DETECT_STALLS"
#: more packages (comma-separated) whose ``check_*`` functions test cells may call, besides ``graders``;
#: their frames are the grader's in a rank's traceback
CHECK_PACKAGES_ENV = "DDP_COURSE_CHECK_PACKAGES"
