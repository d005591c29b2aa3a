import dataclasses
import typing

import pytest

from torchllm.config import ConfigError, JobConfig, help_text, load_config, to_toml
from torchllm.config.docs import render
from torchllm.config.loader import parse_string

from cli import run_module
from conftest import REPO, tiny_args


def write(tmp_path, text):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return str(path)


def test_defaults_without_file():
    cfg = load_config([])
    assert cfg == JobConfig()


def test_precedence_cli_over_toml_over_default(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 50\nseq_len = 64\n[optimizer]\nlr = 1e-3\n")
    cfg = load_config([f"--job.config_file={path}", "--training.steps=7"])
    assert cfg.training.steps == 7  # CLI wins
    assert cfg.training.seq_len == 64  # TOML wins over default
    assert cfg.optimizer.lr == 1e-3
    assert cfg.training.local_batch_size == JobConfig().training.local_batch_size  # default


def test_config_file_can_come_after_overrides(tmp_path):
    path = write(tmp_path, "[training]\nsteps = 50\n")
    cfg = load_config(["--training.steps", "9", "--job.config_file", path])
    assert cfg.training.steps == 9


def test_space_separated_values_and_bare_bool_flag():
    cfg = load_config(["--training.steps", "12", "--job.deterministic", "--training.tf32", "false"])
    assert cfg.training.steps == 12
    assert cfg.job.deterministic is True
    assert cfg.training.tf32 is False


@pytest.mark.parametrize(
    "text, tp, expected",
    [
        ("6e-4", float, 6e-4),
        ("3", float, 3.0),
        ("1_000", int, 1000),
        ("TRUE", bool, True),
        ("off", bool, False),
        ("a,b,c", list[str], ["a", "b", "c"]),
        ("1,2", list[int], [1, 2]),
        ("", list[int], []),
        ("none", int | None, None),
        ("5", int | None, 5),
    ],
)
def test_parse_string_types(text, tp, expected):
    assert parse_string(text, tp) == expected


def test_optional_override_clears_value():
    cfg = load_config(["--model.vocab_size=100", "--model.vocab_size=none"])
    assert cfg.model.vocab_size is None


# What each message must carry: the key (and the flag or file that set it), the value, and what
# is allowed or the key meant ("did you mean"), not its sentence.
@pytest.mark.parametrize(
    "argv, carried",
    [
        (["--training.lr=1"], ("training.lr", "optimizer.lr")),
        (["--optimizer.lrr=1"], ("optimizer.lrr", "optimizer.lr?")),
        (["--trainin.steps=1"], ("[trainin]", "[training]")),
        (["--training.steps=abc"], ("training.steps", "'abc'", "integer")),
        (["--optimizer.lr=fast"], ("optimizer.lr", "'fast'", "number")),
        (["--job.deterministic=maybe"], ("job.deterministic", "'maybe'", "boolean")),
        (["--training.mixed_precision=fp16"], ("training.mixed_precision", "'fp16'",
                                               "'auto' | 'bf16' | 'none'")),
        (["steps=3"], ("'steps=3'", "--section.key=value")),
        (["--training.steps=0"], ("training.steps = 0", "positive")),
        (["--lr_scheduler.min_lr_ratio=2"], ("lr_scheduler.min_lr_ratio = 2.0", "[0, 1]")),
        (["--job.config_file=/nonexistent/x.toml"], ("/nonexistent/x.toml", "job.config_file")),
        (["--checkpoint.initial_load_in_hf"], ("checkpoint.initial_load_in_hf",
                                               "checkpoint.initial_load_path")),
        (["--training.loss_chunk_tokens=0"], ("training.loss_chunk_tokens = 0", "positive")),
    ],
)
def test_cli_errors_name_flag_key_and_fix(argv, carried):
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert all(c in str(e.value) for c in carried), (carried, str(e.value))
    assert "\n" not in str(e.value)
    if argv[0].startswith("--") and "config_file" not in argv[0]:
        assert f"flag {argv[0]}" in str(e.value)


@pytest.mark.parametrize(
    "text, carried",
    [
        ("[training]\nlr = 1\n", ("training.lr", "optimizer.lr")),
        ("[trainig]\nsteps = 1\n", ("[trainig]", "[training]")),
        ('[training]\nsteps = "ten"\n', ("training.steps", "'ten'", "int")),
        ("[training]\nsteps = true\n", ("training.steps", "True", "int")),
        ("[training]\nmax_norm = \"big\"\n", ("training.max_norm", "'big'", "float")),
        ("steps = 3\n", ("'steps'", "[section]")),
        ("[training\n", ("TOML", "line 1")),
    ],
)
def test_toml_errors_name_file_and_key(tmp_path, text, carried):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config([f"--job.config_file={path}"])
    assert all(c in str(e.value) for c in carried), (carried, str(e.value))
    assert path in str(e.value)


def test_empty_run_name_in_a_file_is_unset_but_on_the_command_line_an_error(tmp_path):
    # config.toml files of earlier runs say run_name = "" (unset: the config file's stem).
    path = write(tmp_path, '[job]\nrun_name = ""\n')
    assert load_config([f"--job.config_file={path}"]).job.run_name is None
    with pytest.raises(ConfigError) as e:
        load_config(["--job.run_name="])
    assert "job.run_name = ''" in str(e.value) and "folder name" in str(e.value)


def test_toml_int_accepted_for_float(tmp_path):
    path = write(tmp_path, "[optimizer]\nlr = 1\n")
    assert load_config([f"--job.config_file={path}"]).optimizer.lr == 1.0


def test_to_toml_round_trips(tmp_path):
    cfg = load_config(["--training.steps=3", "--optimizer.lr=6e-4", "--model.vocab_size=77"])
    path = write(tmp_path, to_toml(cfg))
    assert load_config([f"--job.config_file={path}"]) == dataclasses.replace(
        cfg, job=dataclasses.replace(cfg.job, config_file=path)
    )


def test_every_field_has_help_and_appears_in_help_text():
    text = help_text()
    for name, section in JobConfig().sections():
        for f in dataclasses.fields(section):
            assert f.metadata.get("help"), f"{name}.{f.name} has no help string"
            assert f"--{name}.{f.name}" in text


def test_docs_config_md_is_current():
    assert (REPO / "docs" / "config.md").read_text() == render(), (
        "docs/config.md is stale: run python -m torchllm.config.docs > docs/config.md"
    )


def test_train_help_lists_sections():
    r = run_module("torchllm.train", "--help")
    assert r.returncode == 0, r.out[-3000:]
    assert "[optimizer]" in r.stdout and "--optimizer.lr" in r.stdout


def test_every_shipped_config_loads():
    for path in sorted((REPO / "train_configs").glob("*.toml")):
        load_config([f"--job.config_file={path}"])


def float_keys():
    """(dotted key, Field, TOML text setting the key to {value}) of every float field of every
    section, and of every list-of-tables item (e.g. [[data.sources]] weight), by introspection."""
    from torchllm.config.loader import _toml_value, field_types

    out = []
    for section, obj in JobConfig().sections():
        for f in dataclasses.fields(obj):
            tp = field_types(type(obj))[f.name]
            args = typing.get_args(tp)
            if float in (tp, *args):
                out.append((f"{section}.{f.name}", f, f"[{section}]\n{f.name} = {{value}}\n"))
            elif typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
                item = args[0]
                for g in dataclasses.fields(item):
                    gtp = field_types(item)[g.name]
                    if float in (gtp, *typing.get_args(gtp)):
                        rest = "".join(f"{h.name} = {_toml_value(getattr(item(), h.name))}\n"
                                       for h in dataclasses.fields(item) if h is not g)
                        out.append((f"{section}.{f.name}[0].{g.name}", g,
                                    f"[[{section}.{f.name}]]\n{rest}{g.name} = {{value}}\n"))
    return out


def test_every_float_key_refuses_nan_and_inf(tmp_path):
    keys = float_keys()
    assert {"optimizer.lr", "optimizer.beta1", "training.max_norm", "model.rope_theta",
            "data.sources[0].weight"} <= {k for k, _, _ in keys}
    for key, f, text in keys:
        for value in ("nan", "inf", "-inf"):
            path = write(tmp_path, text.format(value=value))
            with pytest.raises(ConfigError) as e:
                load_config([f"--job.config_file={path}"])
            assert e.value.key == key.split("[")[0], (key, value, str(e.value))
            assert f"{key} = {value}" in str(e.value) and ": must be " in str(e.value), e.value
            assert "\n" not in str(e.value)
    # A new float key says what it allows (opt(..., allowed=Range(...)); docs/config.md shows it).
    assert [k for k, f, _ in keys if f.metadata.get("allowed") is None] == []


# key = value, and what is allowed (the range; or what the value means)
@pytest.mark.parametrize("flag, carried", [
    ("--optimizer.beta1=2", ("optimizer.beta1 = 2.0", "[0, 1)")),
    ("--optimizer.beta2=1", ("optimizer.beta2 = 1.0", "[0, 1)")),
    ("--optimizer.eps=0", ("optimizer.eps = 0.0", "> 0 and finite")),
    ("--optimizer.lr=inf", ("optimizer.lr = inf", "> 0 and finite")),
    ("--optimizer.lr=0", ("optimizer.lr = 0.0", "> 0 and finite")),
    ("--optimizer.weight_decay=-0.1", ("optimizer.weight_decay = -0.1", ">= 0 and finite")),
    ("--optimizer.muon_momentum=1", ("optimizer.muon_momentum = 1.0", "[0, 1)")),
    ("--training.max_norm=nan", ("training.max_norm = nan", "finite", "<= 0 disables")),
    ("--model.rope_theta=0", ("model.rope_theta = 0.0", "> 0 and finite")),
    ("--eval.top_p=0", ("eval.top_p = 0.0", "(0, 1]")),
    ("--lr_scheduler.decay_ratio=0", ("lr_scheduler.decay_ratio = 0.0", "(0, 1]")),
    ("--data.sources=embedded=inf", ("data.sources[0].weight = inf", "(embedded)", "> 0")),
    ("--data.sources=embedded=1,embedded=nan", ("data.sources[1].weight = nan", "(embedded)")),
    ("--data.sources=embedded=1e308,embedded=1e308", ("data.sources", "[1e+308, 1e+308]",
                                                      "inf")),
])
def test_float_ranges_name_key_value_and_allowed(flag, carried):
    with pytest.raises(ConfigError) as e:
        load_config([flag])
    assert all(c in str(e.value) for c in carried), (carried, str(e.value))
    assert f"flag {flag}" in str(e.value)


def test_float_range_edges_that_mean_off_are_accepted():
    cfg = load_config(["--training.max_norm=0", "--metrics.loss_spike_factor=0",
                       "--optimizer.beta1=0", "--model.dropout=0", "--eval.temperature=0"])
    assert (cfg.training.max_norm, cfg.metrics.loss_spike_factor) == (0.0, 0.0)
    assert load_config(["--training.max_norm=-1"]).training.max_norm == -1.0  # also off


def test_bad_float_is_exit_2_through_the_entry_point(tmp_path):
    proc = run_module("torchllm.train", *tiny_args(tmp_path, "--optimizer.lr=inf"))
    assert proc.returncode == 2, proc.out[-3000:]
    lines = proc.out.strip().splitlines()
    # one line naming the key, the value and what is allowed
    assert len(lines) == 1 and all(w in lines[0] for w in ("optimizer.lr", "inf", "> 0")), lines
    assert not (tmp_path / "default").exists()  # refused before the run folder was made
