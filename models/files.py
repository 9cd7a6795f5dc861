"""The one error of model files: missing, truncated, malformed or inconsistent ones.

Every loader (GGUF files, HF checkpoint directories with ``config.json`` and safetensors)
checks a file's structure against its size before reading it, and reports what is wrong
as a :class:`ModelFileError` naming the path, so a bad file is a one-line message rather
than a traceback from deep inside numpy or a parser.
"""

from __future__ import annotations

import os


class ModelFileError(ValueError):
    """A model file or checkpoint directory that cannot be loaded as it is.

    ``path`` is the file (or directory) and ``problem`` what is wrong with it; the message
    is ``"{path}: {problem}"`` on one line.
    """

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = os.fspath(path)
        self.problem = " ".join(str(problem).split())  # one line, whatever the cause said
        super().__init__(f"{self.path}: {self.problem}")

    @classmethod
    def truncated(cls, path: str | os.PathLike, what: str, start: int, end: int,
                  size: int) -> ModelFileError:
        """The error for ``what`` needing bytes ``start..end`` of a file of ``size`` bytes."""
        return cls(path, f"truncated file: {what} needs bytes {start}..{end}, file has {size}")

    def __reduce__(self):
        return type(self), (self.path, self.problem)
