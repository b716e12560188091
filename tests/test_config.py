"""Typed configuration: defaults, TOML files, --set overrides and their errors."""

from __future__ import annotations

import dataclasses
import tomllib

import pytest

from hpctrain.training.config import Config, describe
from hpctrain.training.config_load import load_config
from hpctrain.errors import ConfigError, UserError


def write(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def raises_config_error(*needles, path=None, overrides=()):
    """load_config must raise ConfigError whose message contains every needle."""
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    return msg


# ---- defaults and files ------------------------------------------------------------
def test_defaults_validate_and_equal_a_fresh_config():
    cfg = load_config()
    assert cfg == Config()
    assert cfg.validate() is cfg
    assert cfg.optim.name == "sgd" and cfg.train.global_batch == 256 and cfg.model.hidden == [256, 256]


def test_config_error_is_a_user_error():
    assert issubclass(ConfigError, UserError)


def test_toml_file_overrides_defaults_and_keeps_the_rest(tmp_path):
    path = write(tmp_path, """
[model]
hidden = [64, 32, 16]
activation = "gelu"

[optim]
name = "adamw"
lr = 3e-4
nesterov = true

[train]
global_batch = 512
""")
    cfg = load_config(path)
    assert cfg.model.hidden == [64, 32, 16] and cfg.model.activation == "gelu"
    assert cfg.optim.name == "adamw" and cfg.optim.lr == 3e-4 and cfg.optim.nesterov is True
    assert cfg.train.global_batch == 512
    # untouched keys keep their defaults
    assert cfg.train.steps == Config().train.steps
    assert cfg.optim.momentum == Config().optim.momentum


def test_set_overrides_apply_after_the_file(tmp_path):
    path = write(tmp_path, "[optim]\nlr = 0.5\nmomentum = 0.8\n")
    cfg = load_config(path, ["optim.lr=0.05"])
    assert cfg.optim.lr == 0.05      # --set wins over the file
    assert cfg.optim.momentum == 0.8  # the file wins over the default


@pytest.mark.parametrize("override, section, key, expected", [
    ("train.global_batch=1024", "train", "global_batch", 1024),           # int
    ("optim.lr=0.05", "optim", "lr", 0.05),                               # float
    ("optim.lr=1e-3", "optim", "lr", 1e-3),                               # float, exponent
    ("optim.nesterov=true", "optim", "nesterov", True),                   # bool
    ("model.hidden=[64, 32]", "model", "hidden", [64, 32]),               # list of int
    ("model.hidden=[8]", "model", "hidden", [8]),
    ("optim.name=adamw", "optim", "name", "adamw"),                       # bare word -> string
    ('optim.name="adamw"', "optim", "name", "adamw"),                     # quoted string
    ("data.train=runs/my data.h5", "data", "train", "runs/my data.h5"),  # bare path
    ("data.eval=", "data", "eval", ""),                                   # empty = off
    ("optim.lr = 0.25", "optim", "lr", 0.25),                             # spaces around '='
])
def test_set_override_types(override, section, key, expected):
    cfg = load_config(None, [override])
    value = getattr(getattr(cfg, section), key)
    assert value == expected
    assert type(value) is type(expected)


@pytest.mark.parametrize("override, key", [
    ("optim.lr=1", "lr"), ("optim.min_lr=0", "min_lr"), ("train.target_accuracy=1", "target_accuracy"),
])
def test_ints_are_accepted_for_floats_and_become_floats(override, key):
    cfg = load_config(None, [override, "data.eval=eval.h5"])  # a target needs an eval file
    value = getattr(cfg.optim if override.startswith("optim") else cfg.train, key)
    assert type(value) is float and value == float(override.split("=")[1])


def test_ints_accepted_for_floats_in_files(tmp_path):
    cfg = load_config(write(tmp_path, "[optim]\nlr = 2\n"))
    assert type(cfg.optim.lr) is float and cfg.optim.lr == 2.0


# ---- unknown names -----------------------------------------------------------------
def test_unknown_section_suggests_the_close_one():
    raises_config_error("unknown section", "optm", "did you mean 'optim'", overrides=["optm.lr=0.1"])


def test_unknown_key_suggests_the_close_one():
    raises_config_error("unknown key", "optim.lrr", "did you mean 'lr'", overrides=["optim.lrr=0.1"])


def test_unknown_key_in_file_names_the_file_and_suggests(tmp_path):
    path = write(tmp_path, "[train]\nglobal_batc = 64\n")
    raises_config_error(path, "train.global_batc", "did you mean 'global_batch'", path=path)


def test_unknown_section_in_file(tmp_path):
    path = write(tmp_path, "[trian]\nsteps = 5\n")
    raises_config_error("unknown section", "did you mean 'train'", path=path)


def test_top_level_key_outside_a_section_is_rejected(tmp_path):
    raises_config_error("lr", "section", path=write(tmp_path, "lr = 0.1\n"))


@pytest.mark.parametrize("override", ["optim.lr", "lr=3", "=3"])
def test_malformed_override_explains_the_syntax(override):
    raises_config_error("section.key=value", overrides=[override])


# ---- wrong types -------------------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    ('train.global_batch="8"', "train.global_batch"),     # string for int
    ("train.global_batch=abc", "train.global_batch"),     # bare word for int
    ("train.global_batch=true", "train.global_batch"),    # bool for int (bool is an int in Python)
    ("train.steps=1.5", "train.steps"),                   # float for int
    ("train.steps=10.0", "train.steps"),                  # integral float is still not an int
    ("optim.nesterov=1", "optim.nesterov"),               # int for bool
    ("optim.lr=true", "optim.lr"),                        # bool for float
    ("optim.lr=fast", "optim.lr"),                        # string for float
    ("optim.name=1", "optim.name"),                       # int for string
    ("model.hidden=64", "model.hidden"),                  # scalar for list
    ('model.hidden=[64, "a"]', "model.hidden[1]"),        # wrong list item, with its index
    ("model.hidden=[64, 1.5]", "model.hidden[1]"),
])
def test_wrong_types_raise_naming_the_key(override, key):
    raises_config_error(key, "expected", overrides=[override])


def test_wrong_type_in_file_names_the_key(tmp_path):
    raises_config_error("train.global_batch", "expected int",
                        path=write(tmp_path, '[train]\nglobal_batch = "256"\n'))


# ---- out of range ------------------------------------------------------------------
@pytest.mark.parametrize("override, key", [
    ("optim.lr=-0.1", "optim.lr"),
    ("optim.lr=0", "optim.lr"),
    ("train.global_batch=0", "train.global_batch"),
    ("train.steps=-1", "train.steps"),
    ("optim.momentum=1.0", "optim.momentum"),
    ("optim.momentum=-0.1", "optim.momentum"),
    ("optim.weight_decay=-1e-4", "optim.weight_decay"),
    ("optim.beta2=1.0", "beta2"),
    ("optim.name=adam", "optim.name"),                 # unknown choice
    ("optim.schedule=linear", "optim.schedule"),
    ("model.activation=tanh", "model.activation"),
    ("train.dtype=float16", "train.dtype"),
    ("model.hidden=[64, 0]", "model.hidden"),
    ("train.target_accuracy=1.5", "train.target_accuracy"),
    ("optim.min_lr=0.5", "optim.min_lr"),             # above lr=0.1
    ("optim.min_lr=-0.1", "optim.min_lr"),
    ("dist.ranks_per_node=-1", "dist.ranks_per_node"),
    ("checkpoint.writers_per_node=-1", "checkpoint.writers_per_node"),
])
def test_out_of_range_values_raise_naming_the_key(override, key):
    raises_config_error(key, overrides=[override])


def test_unknown_choice_lists_the_choices():
    raises_config_error("sgd", "adamw", overrides=["optim.name=adam"])


# ---- broken files ------------------------------------------------------------------
def test_missing_file_raises_config_error(tmp_path):
    path = str(tmp_path / "nope.toml")
    raises_config_error(path, "not found", path=path)


@pytest.mark.parametrize("text", [
    "[optim\nlr = 0.1\n",            # unclosed table header
    "[optim]\nlr = \n",               # missing value
    "[optim]\nlr = 0.1\nlr = 0.2\n",  # duplicate key
    "[train]\nsteps = 1_\n",          # bad number
])
def test_malformed_toml_raises_config_error(tmp_path, text):
    path = write(tmp_path, text)
    raises_config_error(path, "not valid TOML", path=path)


def test_binary_file_as_config_raises_config_error(tmp_path):
    # e.g. --config data/train.h5 by mistake: not UTF-8, so not TOML either
    path = write(tmp_path, b"\x89HDF\r\n\x1a\n\x00\x00\xff\xfe", name="train.h5")
    raises_config_error(path, path=path)


def test_directory_as_config_raises_config_error(tmp_path):
    raises_config_error(str(tmp_path), path=str(tmp_path))


# ---- round trip and help -----------------------------------------------------------
def non_default_config():
    return load_config(None, [
        "model.hidden=[31, 7, 5]", "model.activation=gelu",
        'data.train=dir with "quotes"\\and\\backslashes.h5', "data.eval=e.h5",
        "train.global_batch=96", "train.dtype=float64", "train.target_accuracy=0.875",
        "optim.name=adamw", "optim.lr=3e-4", "optim.eps=1e-12", "optim.nesterov=true",
        "optim.min_lr=1e-6", "optim.schedule=step", "dist.allreduce=naive",
    ])


@pytest.mark.parametrize("make", [Config, non_default_config])
def test_to_toml_reparses_and_loads_to_an_equal_config(tmp_path, make):
    cfg = make().validate()
    text = cfg.to_toml()
    doc = tomllib.loads(text)
    assert doc == dataclasses.asdict(cfg)
    assert load_config(write(tmp_path, text)) == cfg


def test_to_toml_round_trips_strings_with_control_characters(tmp_path):
    # a file name may hold any byte but NUL and '/', e.g. a tab or a newline
    cfg = Config()
    cfg.train.metrics = "runs/a\tb\nc.jsonl"
    text = cfg.to_toml()
    assert tomllib.loads(text)["train"]["metrics"] == cfg.train.metrics
    assert load_config(write(tmp_path, text)) == cfg


def test_describe_lists_every_key_with_its_default_and_reason():
    text = describe()
    lines = text.splitlines()
    cfg = Config()
    for section in dataclasses.fields(cfg):
        assert f"[{section.name}]" in lines
        for f in dataclasses.fields(getattr(cfg, section.name)):
            matching = [ln for ln in lines if ln.strip().startswith(f"{f.name} = ")]
            assert matching, f"{section.name}.{f.name} missing from describe()"
            assert any(f.metadata["help"] in ln for ln in matching)
    assert 'lr = 0.1' in text and 'name = "sgd"' in text and "hidden = [256, 256]" in text


@pytest.mark.parametrize("override", ["optim.lr=nan", "optim.lr=inf", "optim.weight_decay=inf",
                                      "optim.gamma=-5", "train.seed=-1", "data.shuffle_seed=-1",
                                      "train.target_accuracy=nan"])
def test_non_finite_negative_and_nan_values_are_rejected(override):
    with pytest.raises(ConfigError, match=override.split("=")[0]):
        load_config(None, [override])


def test_target_accuracy_needs_an_eval_file():
    with pytest.raises(ConfigError, match="data.eval is empty"):
        load_config(None, ["train.target_accuracy=0.9", "data.eval="])


@pytest.mark.parametrize("overrides, expect", [
    (["dist.zero=1", "dist.compress=fp16"], "dist.zero=1 with dist.compress='fp16' is not supported"),
    (["dist.zero=2", "dist.allreduce=ring", "dist.compress=topk(0.01)"], "dist.zero=2 with dist.compress="),
    (["dist.zero=4"], "dist.zero=4: choose one of 0, 1, 2, 3"),
    (["dist.zero=3", "dist.compress=fp16"], "dist.zero=3 with dist.compress='fp16' is not supported"),
    (["model.kind=gpt", "dist.zero=3", "dist.pipeline_parallel=2"], "a pipeline stage already holds only its layers"),
    (["dist.zero=3", 'dist.bucket_split="size"'], "gathers the parameters a bucket at a time, one layer unit each"),
    (['dist.bucket_split="rows"'], "dist.bucket_split='rows': choose one of auto, size, layers"),
    (["dist.offload=optimizer", "train.device=cpu"], "there is nothing to offload from"),
    (["dist.offload=host"], "dist.offload='host': choose one of none, optimizer"),
])
def test_zero_settings_that_cannot_run_are_one_clear_error(overrides, expect):
    from hpctrain.training.config_load import load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert expect in str(err.value)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_zero_3_and_offload_run_in_16_bits(precision):
    from hpctrain.training.config_load import load_config

    cfg = load_config(None, ["dist.zero=3", f"train.precision={precision}"])
    assert cfg.dist.zero == 3 and cfg.train.precision == precision
    cfg = load_config(None, ["dist.offload=optimizer", "train.device=cuda", f"train.precision={precision}"])
    assert cfg.dist.offload == "optimizer" and cfg.train.precision == precision


MOMENTUM_OK = ["dist.compress='topk(0.01)'", "dist.compress_momentum=true", "optim.name='adamw'",
               "optim.freeze_step=10", "dist.compress_start_step=10"]


def test_compress_momentum_validates_with_adamw_and_the_freeze_at_compressions_start():
    cfg = load_config(None, MOMENTUM_OK)
    assert cfg.dist.compress_momentum and cfg.optim.freeze_step == cfg.dist.compress_start_step == 10


@pytest.mark.parametrize("change,needles", [
    ("dist.compress='none'", ("compress_momentum", "compresses nothing")),
    ("optim.name='sgd'", ("compress_momentum", "adamw")),
    ("optim.freeze_step=20", ("freeze_step = dist.compress_start_step", "20 and 10")),
    ("dist.compress_start_step=0", ("> 0", "10 and 0")),
])
def test_compress_momentum_refuses_what_it_cannot_correct(change, needles):
    sets = [s for s in MOMENTUM_OK if s.split("=")[0] != change.split("=")[0]] + [change]
    if change == "optim.name='sgd'":  # (SGD has no freeze step to set)
        sets = [s for s in sets if not s.startswith("optim.freeze_step")]
    raises_config_error(*needles, overrides=sets)


def test_min_lr_is_bounded_by_the_scaled_peak_not_the_configured_lr():
    """Under the linear scaling rule the schedule's peak is lr x global_batch / base_batch: a floor
    under optim.lr but above that peak is refused, and one above optim.lr but under it is not."""
    base = ["optim.scale_lr=true", "optim.lr=0.1", "optim.base_batch=256"]
    msg = raises_config_error("optim.min_lr=0.06", "peak learning rate 0.05",
                              overrides=base + ["train.global_batch=128", "optim.min_lr=0.06"])
    assert "optim.scale_lr" in msg
    cfg = load_config(None, base + ["train.global_batch=1024", "optim.min_lr=0.2"])   # peak 0.4
    assert cfg.optim.min_lr == 0.2
