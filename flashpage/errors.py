"""The error bad input raises: a ValueError that names the parameter at fault (the server's 400 reports it)."""

from __future__ import annotations


class ParameterError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # (pickled whole: the engine's process sends it to the server's)
        return ParameterError, (self.param, str(self))


class DictSetting:
    """A dict-valued engine setting (`speculative_config`, `sparse_attention`) as it is checked: a dict holding
    only `fields`' keys; every error names `setting.key`."""

    def __init__(self, setting: str, d, fields):
        self.setting, self.d = setting, d
        if not isinstance(d, dict):
            raise ParameterError(setting, f"{setting} must be a dict, got {d!r}")
        unknown = sorted(set(d) - set(fields))
        if unknown:
            self.bad(unknown[0], f"is not a known key (known: {', '.join(sorted(fields))})")

    def bad(self, key: str, why: str):
        raise ParameterError(f"{self.setting}.{key}", f"{self.setting}: {key} {why}")

    def integer(self, key: str, low: int, default=None) -> None:
        """The key's value (or `default` where it is absent) is an integer >= low."""
        v = self.d.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            self.bad(key, f"must be an integer >= {low}, got {v!r}")
