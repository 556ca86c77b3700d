"""The error bad input raises: a ValueError that names the parameter at fault (the server's 400 reports it)."""

from __future__ import annotations


class ParameterError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
