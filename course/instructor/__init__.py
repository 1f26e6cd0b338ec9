"""The instructor workflow on nbgrader: one module per ``ddp-course`` verb.

``init`` makes an nbgrader course directory from the course's exercises,
``release`` generates the student copies, ``collect`` files students'
notebooks, ``autograde`` grades them in parallel, ``feedback``, ``export`` and
``status`` report, and ``demo`` runs all of it on sample submissions. Every verb
works on nbgrader's own gradebook, so plain ``nbgrader`` commands keep working
in the same directory.
"""
