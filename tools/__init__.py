"""Developer tools run from the repository root (``python tools/make_models.py``, ``tools/bench.py``,
``tools/accuracy.py``) and the test and benchmark model builders (:mod:`tools.builders`).

Not part of the shipped package: tests import it through pytest's ``pythonpath = ["."]``
(pyproject.toml), and each tool script puts the repository root on ``sys.path`` itself.
"""
