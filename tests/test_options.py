"""The server's options are declared once (helpers/server/options.py): the command's flags,
serve_in_background's keywords and the engine's defaults all come from that table."""

import inspect

import pytest

from helpers.server import options, serve_in_background
from helpers.server.__main__ import build_parser
from helpers.server.engine_process import torch_threads
from helpers.server.engine import Engine

#: The flags that are plumbing between serve_in_background and the process, not options.
PLUMBING = {"--port-file", "--watch-stdin", "--help"}


def test_the_command_has_one_flag_per_option_with_its_default():
    parser = build_parser()
    flags = {flag for action in parser._actions for flag in action.option_strings
             if flag.startswith("--")}
    assert flags - PLUMBING == {option.flag for option in options.OPTIONS}
    defaults = vars(parser.parse_args([]))
    for option in options.OPTIONS:
        assert defaults[option.name] == option.default, option.name


def test_the_engine_takes_its_defaults_from_the_table():
    signature = inspect.signature(Engine.__init__).parameters
    assert set(options.ENGINE_OPTIONS) <= set(options.DEFAULTS)
    for name in options.ENGINE_OPTIONS:
        assert signature[name].default == options.DEFAULTS[name], name


def test_keywords_become_flags_that_parse_back_to_the_same_values():
    values = {"max_batch_size": 12, "threads": 1, "adapters": "some/folder", "kv_cache": "paged",
              "log_level": "info", "model": None}
    flags = options.command_line(values)
    assert "--model" not in flags                          # None: the default, left out
    parsed = vars(build_parser().parse_args(flags))
    assert {k: parsed[k] for k in values if values[k] is not None} == {
        k: v for k, v in values.items() if v is not None}
    assert parsed["max_queue"] == options.DEFAULTS["max_queue"]


@pytest.mark.parametrize("bad, words", [
    ({"max_batch": 8}, "'max_batch' is not a server option"),
    ({"max_batch_size": "8"}, "max_batch_size must be an integer"),
    ({"max_batch_size": True}, "max_batch_size must be an integer"),
    ({"kv_cache": "paged!"}, "kv_cache must be one of paged, contiguous"),
])
def test_a_wrong_option_is_refused_before_anything_starts(bad, words):
    with pytest.raises(ValueError, match=words):
        options.command_line(bad)
    with pytest.raises(ValueError, match=words):     # no process is started for it
        serve_in_background(**bad, name="never-started")


def test_every_option_is_documented_where_it_is_used():
    doc = serve_in_background.__doc__
    assert all(f"{option.name}:" in doc for option in options.OPTIONS)
    help_text = build_parser().format_help()
    assert f"(default: {options.DEFAULTS['max_batch_size']})" in help_text
    assert all(option.flag in help_text for option in options.OPTIONS)


def test_torch_threads_leave_a_core_on_the_cpu(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert torch_threads(None, "cpu") == 7
    assert torch_threads(3, "cpu") == 3
    assert torch_threads(None, "cuda:0") == 1     # a GPU's CPU side builds small tensors
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert torch_threads(None, "cpu") == 1
    with pytest.raises(ValueError, match="--threads 0: must be between 1 and"):
        torch_threads(0, "cpu")


@pytest.mark.parametrize("bad, words", [
    ({"max_input_tokens": 200, "max_total_tokens": 100},
     r"max_input_tokens \(200\) must be smaller"),
    ({"compile": "on", "kv_cache": "contiguous"}, "--compile on needs --kv-cache paged"),
    ({"cuda_graph_sizes": "0"}, "'0' is not one"),
    ({"admission": "lifo"}, "admission must be one of fcfs, shortest, got 'lifo'"),
])
def test_every_way_in_reaches_the_one_judge(bad, words, monkeypatch):
    """serve_in_background, the engine's process (build_engine) and Engine(...) built from
    Python refuse a bad setting with the same words, before a process starts or a model loads:
    options.check is the only place a setting is judged."""
    from types import SimpleNamespace

    import torch

    from helpers.server.engine_process import build_engine

    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were judged")

    monkeypatch.setattr("helpers.models.load_model", no_loading)
    with pytest.raises(ValueError, match=words):
        serve_in_background(**bad, name="never-started")
    with pytest.raises(ValueError, match=words):
        build_engine({**bad, "device": "cpu"})
    model = SimpleNamespace(config=SimpleNamespace(n_positions=1024), device=torch.device("cpu"))
    keywords = {("graph_sizes" if name == "cuda_graph_sizes" else name): value
                for name, value in bad.items()}
    with pytest.raises(ValueError, match=words):
        Engine(model, None, **keywords)
