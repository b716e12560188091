"""Property-based fuzz of the config loader (hypothesis; serial).

Property: ``load_config(file, overrides)`` returns a Config that validates and
round-trips through ``to_toml`` (what rank 0 prints and checkpoints store), or
raises :class:`ConfigError` with a short one-line message. Never another
exception, never a hang (each test has a timeout), and nothing in a file or an
override is ever executed: code payloads in keys and values must not create
their marker file. ``derandomize`` makes every run draw the same examples.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
import tempfile

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import REPO
from hpctrain.training.config import Config
from hpctrain.training.config_load import load_config
from hpctrain.errors import ConfigError, UserError

SCALE = float(os.environ.get("HPCTRAIN_FUZZ_SCALE", "1"))  # e.g. 20 for a long soak; CI runs 1
FUZZ = settings(max_examples=int(300 * SCALE), deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
MARKER = os.path.join(tempfile.gettempdir(), f"hpctrain-fuzz-EXECUTED-{os.getpid()}")  # made only if a payload ran
PAYLOADS = [f"__import__('os').system('touch {MARKER}')", f"$(touch {MARKER})", f"`touch {MARKER}`",
            f"{{__import__('os').system('touch {MARKER}')}}", f"!!python/object/apply:os.system ['touch {MARKER}']",
            f"open('{MARKER}', 'w')", "{0.__class__.__mro__[1].__subclasses__}", "%s%s%n%x", "${HOME}"]
SECTIONS = {s.name: [f.name for f in dataclasses.fields(s.default_factory())] for s in dataclasses.fields(Config)}
KEYS = sorted({k for keys in SECTIONS.values() for k in keys})
PLAUSIBLE = ["sgd", "adamw", "relu", "gelu", "mpi", "ring", "rhd", "auto", "cpu", "float64", "none", "fp16",
             "topk(0.01)", "powersgd(2, 5)", "inter", "on", ""]


class Raw:
    """A TOML literal written as is: forms Python values cannot produce (a short repr for reports)."""

    def __init__(self, text):
        self.text = text

    def __repr__(self):
        return f"Raw({self.text[:24]!r}{'...' if len(self.text) > 24 else ''})"


RAW = [Raw("9" * 5000), Raw("-" + "9" * 30), Raw("nan"), Raw("-inf"), Raw("+inf"), Raw("0x7fffffffffffffff"),
       Raw("0o777"), Raw("0b101"), Raw("1_000"), Raw("1979-05-27T07:32:00Z"), Raw("07:32:00"),
       Raw("'''multi\nline'''"), Raw('"""\\u0000"""'), Raw("[" * 400 + "]" * 400), Raw("{a=" * 600 + "1" + "}" * 600),
       Raw("'\U0001F600\u202e'"), Raw("[1, 'a', 2.5, true, [], {}]")]

names = st.one_of(st.sampled_from(KEYS), st.sampled_from(list(SECTIONS)), st.text(max_size=12),
                  st.sampled_from(PAYLOADS))
scalars = st.one_of(st.booleans(), st.integers(-300, 300), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 1), st.text(max_size=20),
                    st.sampled_from(PLAUSIBLE + PAYLOADS), st.sampled_from(RAW), st.datetimes(), st.dates(),
                    st.times(), st.lists(st.integers(1, 64), max_size=3))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(names, inner, max_size=3)), max_leaves=8)
# a real section with its real keys most of the time, so documents reach the type and range checks
pairs = st.one_of(st.sampled_from([(s, k) for s, keys in SECTIONS.items() for k in keys]), st.tuples(names, names))


@st.composite
def documents(draw):
    top = draw(st.dictionaries(names, scalars, max_size=1))  # a key outside any table
    sections = {}
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.one_of(st.sampled_from(list(SECTIONS)), names))
        keys = st.one_of(st.sampled_from(SECTIONS.get(name, KEYS)), names)
        sections[name] = draw(st.dictionaries(keys, values, max_size=4))
    return top, sections


def _key(name: str) -> str:
    return json.dumps(name, ensure_ascii=False).replace("\x7f", "\\u007f")


def toml(v) -> str:
    if isinstance(v, Raw):
        return v.text
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) else repr(v)
    if isinstance(v, str):
        return _key(v)
    if isinstance(v, list):
        return "[" + ", ".join(toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {toml(x)}" for k, x in v.items()) + "}"
    return v.isoformat() if hasattr(v, "isoformat") else str(v)


def render(doc) -> bytes:
    top, sections = doc
    lines = [f"{_key(k)} = {toml(v)}" for k, v in top.items()]
    for name, table in sections.items():
        lines += [f"[{_key(name)}]"] + [f"{_key(k)} = {toml(v)}" for k, v in table.items()]
    return "\n".join(lines).encode("utf-8", "surrogatepass")


@st.composite
def config_bytes(draw):
    """A rendered document, the same with random byte edits, or plain random bytes."""
    kind = draw(st.sampled_from(["doc", "mutated", "binary"]))
    if kind == "binary":
        return draw(st.binary(max_size=600))
    data = bytearray(render(draw(documents())))
    for _ in range(draw(st.integers(1, 4)) if kind == "mutated" else 0):
        at = draw(st.integers(0, len(data)))
        data[at:at + draw(st.integers(0, 3))] = draw(st.binary(max_size=4))
    return bytes(data)


overrides = st.lists(st.one_of(
    st.builds(lambda p, v: f"{p[0]}.{p[1]}={toml(v)}", pairs, values),
    st.builds(lambda p, v: f"{p[0]}.{p[1]}={v}", pairs, st.one_of(st.text(max_size=30), st.sampled_from(PAYLOADS))),
    st.text(max_size=40)), max_size=3)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-config")


def check_loads_or_refuses(work, path, sets):
    """The property; returns the Config or None (refused with a good ConfigError)."""
    try:
        cfg = load_config(path, sets)
    except ConfigError as exc:
        text = str(exc)
        assert text and "\n" not in text and len(text) < 1500, text  # one readable line
        event("refused")
        return None
    finally:
        assert not os.path.exists(MARKER), "a payload from the config was executed"
    cfg.validate()
    again = os.path.join(work, "resolved.toml")
    with open(again, "w", encoding="utf-8") as fh:  # strict: the resolved config must be UTF-8
        fh.write(cfg.to_toml())
    assert load_config(again) == cfg  # what checkpoints store loads back to the same run
    event("loaded")
    return cfg


@pytest.mark.timeout(int(120 * SCALE))
@FUZZ
@given(content=config_bytes(), sets=overrides)
def test_any_config_file_loads_or_raises_config_error(work, content, sets):
    path = os.path.join(work, "fuzz.toml")
    with open(path, "wb") as fh:
        fh.write(content)
    check_loads_or_refuses(work, path, sets)


@pytest.mark.timeout(int(60 * SCALE))
@FUZZ
@given(sets=overrides)
def test_any_set_override_loads_or_raises_config_error(work, sets):
    check_loads_or_refuses(work, None, sets)


@pytest.mark.timeout(int(60 * SCALE))
@settings(FUZZ, max_examples=int(100 * SCALE))
@given(section=st.sampled_from(list(SECTIONS)), data=st.data())
def test_well_typed_values_of_real_keys_load_or_raise(work, section, data):
    """Real section and key with a value of a plausible type: the range checks' side of the property."""
    key = data.draw(st.sampled_from(SECTIONS[section]))
    value = data.draw(st.one_of(st.integers(-2**64, 2**64), st.sampled_from([10**309, -10**400]), st.floats(),
                                st.sampled_from(PLAUSIBLE),
                                st.lists(st.integers(-2, 2**65), max_size=3)))
    check_loads_or_refuses(work, None, [f"{section}.{key}={toml(value)}"])


def test_config_errors_are_user_errors():
    assert issubclass(ConfigError, UserError)


NASTY = {  # each must stop the CLI with exit 2 and one message naming the problem, before any training
    "payloads.toml": ("[train]\n" + "\n".join(f"{_key(p)} = {_key(p)}" for p in PAYLOADS[:3]), "unknown key"),
    "huge-int.toml": (f"[train]\nsteps = {'9' * 5000}\n", "4300 digits"),
    "deep.toml": ("[model]\nhidden = " + "{a=" * 600 + "1" + "}" * 600 + "\n", "RecursionError"),
    "nul.toml": ('[checkpoint]\ndir = "runs/\\u0000ck"\n', "NUL character"),
    "nan.toml": ("[optim]\nlr = nan\n", "optim.lr=nan: must be a finite number"),
    "int64.toml": ("[model]\nhidden = [18446744073709551616]\n", "does not fit in 64 bits"),
    "binary.toml": (bytes(range(256)) * 4, "not valid TOML"),
    "big.toml": ("# " + "x" * (2 << 20) + "\n", "larger than 1 MiB"),
}


# Through the real command line: the one file whose outcome depends on the process (its stack
# depth: RecursionError in the parser); each file also goes through the same code in this process.
NASTY_CLI = ("deep.toml",)


@pytest.mark.timeout(480)  # one CLI start of ~1 s; generous for a loaded CI machine
def test_nasty_config_files_through_the_cli_exit_2_with_one_message(work, capsys):
    """Each file goes through what ``python -m hpctrain train --config FILE`` runs on every rank
    (load_config inside agree, then the trainer's set-up) and is reported as the command reports
    failures: exit 2, one error line holding the fragment, no traceback (test_cli._one_error_in_process,
    whose docstring names the real launches of this mechanism). The files of NASTY_CLI also go through
    the real command line, with the same checks."""
    from test_cli import _one_error_in_process, _train_setup

    for name, (content, fragment) in NASTY.items():
        path = os.path.join(work, name)
        with open(path, "wb") as fh:
            fh.write(content if isinstance(content, bytes) else content.encode())
        _one_error_in_process(capsys, _train_setup("--config", path), fragment)
        assert not os.path.exists(MARKER), name
        if name in NASTY_CLI:
            proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", "--config", path], cwd=REPO,
                                  capture_output=True, text=True, timeout=120)
            errors = [line for line in proc.stderr.splitlines() if "hpctrain: error:" in line]
            assert proc.returncode == 2 and len(errors) == 1, (name, proc.returncode, proc.stderr)
            assert "Traceback" not in proc.stderr and fragment in errors[0], (name, proc.stderr)
            assert not os.path.exists(MARKER), name
