"""Reading a run configuration: the defaults, then a TOML file, then ``--set`` overrides; or the
configuration text a checkpoint stores.

Contract:
  * unknown sections or keys, wrong types and out-of-range values raise
    :class:`~hpctrain.errors.ConfigError` naming the key and the fix;
  * :func:`load_config` is pure (no MPI): every rank parses the same inputs.
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import typing

from ..errors import ConfigError
from .config import Config


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _coerce(where: str, value, typ):
    """Check ``value`` against the annotated type; ints are accepted for floats."""
    origin = typing.get_origin(typ)
    if origin is list:
        (item,) = typing.get_args(typ)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of {item.__name__}, got {repr(value)[:80]}")
        return [_coerce(f"{where}[{i}]", x, item) for i, x in enumerate(value)]
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:76] + " ..."  # a pasted blob must not flood the log
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > 1e300:  # float() would raise OverflowError; no setting needs such a number
            raise ConfigError(f"{where}: {shown} is too large; give a number below 1e300")
        return float(value)
    if typ is int and isinstance(value, bool) or not isinstance(value, typ):
        raise ConfigError(f"{where}: expected {typ.__name__}, got {type(value).__name__} {shown}")
    if typ is int and not -2**63 <= value < 2**63:  # numpy and MPI counts are 64-bit
        raise ConfigError(f"{where}: {shown} does not fit in 64 bits; give a smaller number")
    if typ is str:
        # paths reach open() and checkpoints store the config as UTF-8: a NUL or a lone surrogate
        # (non-UTF-8 bytes on the command line) would fail there, far from the cause
        if "\x00" in value:
            raise ConfigError(f"{where}: {shown} contains a NUL character; remove it")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"{where}: {shown} is not valid UTF-8 text; use UTF-8 names (rename the "
                              f"file or directory if it has a non-UTF-8 name)") from None
    return value


def _apply(cfg: Config, section: str, key: str, value, origin: str):
    sections = {f.name: f for f in dataclasses.fields(cfg)}
    # names from a file may be anything (a newline, a megabyte): shown plainly only when plain
    section, key = (n if n.isidentifier() else repr(n[:60]) for n in (section, key))
    if section not in sections:
        raise ConfigError(f"{origin}: unknown section [{section}]{_suggest(section, sections)}; "
                          f"sections are {', '.join(sections)}")
    sub = getattr(cfg, section)
    hints = typing.get_type_hints(type(sub))
    if key not in hints:
        raise ConfigError(f"{origin}: unknown key {section}.{key}{_suggest(key, hints)}; "
                          f"keys of [{section}] are {', '.join(hints)}")
    setattr(sub, key, _coerce(f"{origin}: {section}.{key}", value, hints[key]))


def _parse_override(text: str):
    """``section.key=value`` -> (section, key, value); the value is read as TOML, else as a string."""
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(f"--set {text[:80]!r}: expected section.key=value, e.g. --set optim.lr=0.05")
    lhs, raw = text.split("=", 1)
    section, key = lhs.strip().split(".", 1)
    try:
        doc = tomllib.loads(f"v = {raw}")
        # "1\n[optim]\nlr = 5" parses as more than v: a string then, never a silently dropped rest
        value = doc["v"] if len(doc) == 1 else raw
    except tomllib.TOMLDecodeError:
        value = raw  # bare words such as adamw or a path
    except (ValueError, RecursionError) as exc:  # an integer of > 4300 digits, nesting beyond the stack
        raise ConfigError(f"--set {text[:80]!r}: the value cannot be read ({type(exc).__name__}); "
                          f"give a plain number, string or short list") from None
    return section, key, value


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the TOML file at ``path``, then ``--set`` overrides; validated."""
    doc = {}
    if path:
        try:
            limit = 1 << 20  # configs are a few KB; /dev/zero or a dataset passed by mistake must not fill memory
            with open(path, "rb") as fh:
                text = fh.read(limit + 1)
            if len(text) > limit:
                raise ConfigError(f"config file {path!r} is larger than 1 MiB, so not a config; pass the "
                                  f"TOML file to --config")
            doc = _parse_toml(text.decode("utf-8"), f"config file {path!r}")
        except FileNotFoundError:
            raise ConfigError(f"config file {path!r} not found; pass an existing file to --config") from None
        except OSError as exc:
            raise ConfigError(f"config file {path!r} cannot be read ({exc.strerror or exc}); "
                              f"pass a readable TOML file to --config") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path!r} is not valid TOML: {exc}") from None
    cfg = _from_doc(doc, path)
    for text in overrides:
        shown = text if text.isprintable() and len(text) <= 80 else repr(text[:76]) + (" ..." if len(text) > 76 else "")
        _apply(cfg, *_parse_override(text), origin=f"--set {shown}")  # one line, whatever was typed
    return cfg.validate()


def load_config_text(text: str, origin: str) -> Config:
    """The config in TOML ``text`` (e.g. the one a checkpoint stores), over the defaults; validated."""
    return _from_doc(_parse_toml(text, origin), origin).validate()


def _parse_toml(text: str, origin: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{origin} is not valid TOML: {exc}") from None
    except (ValueError, RecursionError) as exc:  # > 4300-digit integers, nesting beyond the stack
        raise ConfigError(f"{origin} cannot be read as a config ({type(exc).__name__}: "
                          f"{str(exc).split(':')[0][:120]}); use plain numbers, strings and short lists") from None


def _from_doc(doc: dict, origin) -> Config:
    cfg = Config()
    for section, table in doc.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{origin}: top-level key {section[:60]!r} must be a [section] table")
        for key, value in table.items():
            _apply(cfg, section, key, value, origin)
    return cfg
