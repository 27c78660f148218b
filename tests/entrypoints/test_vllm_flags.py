"""vLLM's serve command lines: accepted with vLLM's spelling, value syntax and meaning, or
refused by name with the nearest conveyor option; never a bare "unrecognized arguments".

Runs in the test process in milliseconds: the flags are parsed and the configuration built, no
process starts (tests/frontend/test_http_vllm_cli.py serves real command lines). The command
lines are vLLM's documentation's, with the tiny model's directory for the model id.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from conveyor.entrypoints import serve
from conveyor.entrypoints.serve_config import ServeConfig
from conveyor.frontend.engine_args import EngineArgs
from conveyor.frontend.server import main as frontend_main
from conveyor.frontend.server.chat_tools import chat_tools
from conveyor.frontend.server.errors import ApiError
from conveyor.frontend.server.request_models import ChatCompletionRequest, decode_body
from conveyor.frontend.vllm_flags import ENGINE_FLAGS, SERVER_FLAGS, flags_without_effect
from conveyor.protocol import ConfigError
from conveyor.runtime.flags import human_readable_int, human_readable_int_or_auto
from tests.commands import CONVEYOR

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"


def parse(command_line: str, model: Path | None = None) -> argparse.Namespace:
    """``vllm serve ...`` as conveyor serve reads it (MODEL: the tiny model)."""
    argv = shlex.split(command_line)
    return serve.parse_args([str(model) if a == "MODEL" else a for a in argv])


def refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        serve.parse_args(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "text, value",
    [("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("1m", 10**6),
     ("2M", 2 << 20), ("8G", 8 << 30), ("8g", 8 * 10**9)],
)  # fmt: skip
def test_vllms_number_syntax(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5K", "k", "12x", "nan", "infk", ""])
def test_what_is_no_number_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


@pytest.mark.parametrize("text", ["auto", "-1", "AUTO"])
def test_auto_and_minus_one_mean_what_fits(text):
    assert human_readable_int_or_auto(text) is None  # the model's, lowered to what the KV holds


def test_the_tool_calling_recipe(tiny_model_dir):
    """vLLM's tool-calling docs, with the flags a user adds to them."""
    args = parse(
        "MODEL -tp 1 --max-model-len 4k --served-model-name main alias "
        "--enable-auto-tool-choice --tool-call-parser hermes --trust-remote-code "
        "--uvicorn-log-level info",
        tiny_model_dir,
    )
    config = ServeConfig.from_args(args)
    engine = config.engines.engine
    assert engine.parallel.tensor_parallel_size == 1
    assert engine.model.max_model_len == 4000 and engine.model.tool_call_parser == "hermes"
    assert config.frontends.served_model_names == ("main", "alias")
    assert config.frontends.served_model_name == "main"
    options = config.frontends.options
    names = options.index("--served-model-name")
    assert options[names + 1 : names + 3] == ("main", "alias")
    assert config.frontends.http.uvicorn_log_level == "info"
    assert options[options.index("--uvicorn-log-level") + 1] == "info"
    assert [flag for flag, _ in flags_without_effect(args)] == ["--trust-remote-code"]


@pytest.mark.parametrize(
    "command_line, expected",
    [
        # Quickstart: the OpenAI-compatible server.
        ("MODEL --dtype auto --api-key token-abc123", {"api_keys": ("token-abc123",)}),
        # Distributed serving, data parallel deployment.
        ("MODEL -dp 2 -tp 1 --api-server-count 2", {"dp": 2, "frontends": 2}),
        ("MODEL --data-parallel-size 2 -asc 3", {"dp": 2, "frontends": 3}),
        # Engine arguments' value syntax.
        ("MODEL --max-model-len 3K --max-num-batched-tokens 8k", {"len": 3072, "budget": 8000}),
        ("MODEL --max-model-len auto", {"len": 4096}),
        ("MODEL --max-model-len=-1", {"len": 4096}),
        ("MODEL --max_model_len 2048 --max_num_seqs 8", {"len": 2048, "seqs": 8}),
        ("MODEL --kv-cache-memory-bytes 64M", {"kv": 64 << 20}),
        ("MODEL --kv-cache-memory-bytes 64m", {"kv": 64 * 10**6}),
        ("MODEL --enforce-eager --no-enable-prefix-caching", {"eager": True, "prefix": False}),
        ("MODEL --scheduling-policy priority --disable-log-stats", {"queue": "priority"}),
        ("MODEL --distributed-executor-backend uni", {"backend": "inprocess"}),
        ("MODEL --generation-config vllm --override-generation-config "
         """'{"temperature": 0.5, "max_new_tokens": 64}'""",
         {"defaults": {"temperature": 0.5, "max_tokens": 64}}),
        ("MODEL --shutdown-timeout 30", {"drain": 30.0}),
        ("MODEL --max-logprobs 50", {"logprobs": 50}),
        ("MODEL --max-logprobs -1", {"logprobs": 2048}),  # the tiny model's vocabulary
    ],
)  # fmt: skip
def test_vllm_command_lines_mean_what_they_mean_in_vllm(tiny_model_dir, command_line, expected):
    args = parse(command_line, tiny_model_dir)
    config = ServeConfig.from_args(args)
    engine = config.engines.engine
    got = {
        "api_keys": config.frontends.api_keys,
        "dp": engine.parallel.data_parallel_size,
        "frontends": config.frontends.count,
        "len": engine.model.max_model_len,
        "budget": engine.scheduler.max_num_batched_tokens,
        "seqs": engine.scheduler.max_num_seqs,
        "kv": engine.cache.kv_cache_memory,
        "eager": engine.enforce_eager,
        "prefix": engine.cache.enable_prefix_caching,
        "queue": engine.scheduler.queue_order,
        "backend": config.engines.executor_backend,
        "defaults": engine.model.sampling_defaults,
        "drain": config.frontends.drain_timeout_s,
        "logprobs": engine.model.max_logprobs,
    }
    assert {key: got[key] for key in expected} == expected
    if "--disable-log-stats" in command_line:
        assert engine.observability.stats_interval_s == 0


def test_a_config_file_gives_flags_and_the_command_line_wins(tiny_model_dir, tmp_path):
    (tmp_path / "serve.yaml").write_text(
        "max_model_len: 2048\nmax-num-seqs: 16\nserved-model-name: [a, b]\n"
        "enable-prefix-caching: false\nenforce_eager: true\ndisable-log-requests: true\n"
        'override-generation-config: {"temperature": 0.1}\n'
    )
    args = parse(f"MODEL --config {tmp_path / 'serve.yaml'} --max-num-seqs 4", tiny_model_dir)
    config = ServeConfig.from_args(args)
    assert config.engines.engine.model.max_model_len == 2048
    assert config.engines.engine.scheduler.max_num_seqs == 4, "the command line wins"
    assert config.frontends.served_model_names == ("a", "b")
    assert config.engines.engine.enforce_eager
    assert config.engines.engine.model.sampling_defaults["temperature"] == 0.1


@pytest.mark.parametrize(
    "flag", [f for f in ENGINE_FLAGS + SERVER_FLAGS if f.refused], ids=lambda f: f.names[0]
)
def test_a_flag_for_what_conveyor_lacks_is_refused_by_name(flag, capsys):
    value = [] if flag.nargs == 0 else ["x"]
    shown = " x" if flag.nargs in (None, "?") else ""
    for name in flag.names:
        err = refusal([name, *value], capsys)
        assert f"{name}{shown}: refused, conveyor lacks what this vLLM flag asks for" in err
        assert flag.why in err and "unrecognized" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--pipeline-parallel-size", "1"],
        ["-pp", "1"],
        ["--enable-chunked-prefill"],
        ["--enable-chunked-prefill", "True"],
        ["--load-format", "safetensors"],
        ["--tokenizer-mode", "auto"],
        ["--task", "generate"],
        ["--data-parallel-backend", "mp"],
        ["--response-role", "assistant"],
        ["--preemption-mode", "recompute"],
        ["--trust-remote-code", "--disable-log-requests", "--disable-fastapi-docs"],
        ["--swap-space", "4", "--disable-uvicorn-access-log", "-O3", "--max-log-len", "100"],
        ["--compilation-config", '{"level": 3}', "--cuda-graph-sizes", "1", "2", "4"],
    ],
)
def test_what_conveyor_always_does_is_accepted_with_no_effect(argv):
    args = serve.parse_args(argv)
    assert flags_without_effect(args)


def test_an_unknown_flag_names_the_closest_ones(capsys):
    err = refusal(["--max-modle-len", "5"], capsys)
    assert "did you mean --max-model-len" in err and "conveyor serve --help" in err


def test_every_refused_and_ignored_flag_is_in_the_docs_table():
    text = DOCS.read_text()
    table = text[text.index("## vLLM flags") :]
    missing = [n for f in ENGINE_FLAGS + SERVER_FLAGS for n in f.names if f"`{n}" not in table]
    assert missing == []


def test_the_frontend_command_takes_the_same_server_flags():
    args = frontend_main.parse_args(
        ["--engine", "ipc:///nowhere", "--served-model-name", "a", "b", "--api-key", "k1", "k2"]
        + ["--allowed-origins", '["https://example.com"]', "--root-path", "/api/"]
        + ["--disable-fastapi-docs", "--shutdown-timeout", "3"]
    )
    assert args.served_model_name == ["a", "b"] and args.api_key == ["k1", "k2"]
    assert args.http.cors.origins == ("https://example.com",) and args.http.cors.methods == ("*",)
    assert args.http.root_path == "/api" and args.drain_timeout_s == 3.0


def test_api_keys_come_from_the_flag_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(frontend_main.API_KEY_ENV, raising=False)
    monkeypatch.setenv(frontend_main.VLLM_API_KEY_ENV, "from-vllm-env")
    keys = frontend_main.resolve_api_keys
    assert keys(serve.parse_args([])) == ("from-vllm-env",)
    assert keys(serve.parse_args(["--api-key", "a", "b", "--api-key", "c"])) == ("a", "b", "c")
    (tmp_path / "keys").write_text("one\n\ntwo\n")
    assert keys(serve.parse_args(["--api-key-file", str(tmp_path / "keys")])) == ("one", "two")
    monkeypatch.setenv(frontend_main.API_KEY_ENV, "x\ny")
    assert keys(serve.parse_args([])) == ("x", "y")
    assert frontend_main.api_key_env(("x", "y")) == {frontend_main.API_KEY_ENV: "x\ny"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ssl-certfile", "c.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (["--ssl-ca-certs", "ca.pem"], "need --ssl-keyfile"),
        (["--ssl-keyfile", "/no/key", "--ssl-certfile", "/no/cert"], "TLS (--ssl-keyfile"),
        (["--root-path", "api"], "--root-path must start with /"),
        (["--allowed-origins", '{"a": 1}'], "must be a JSON list of strings"),
        (["--max-model-len", "1.5K"], "a binary suffix (K) takes a whole number"),
        (["--override-generation-config", "[1]"], "must be a JSON object"),
    ],
)
def test_bad_server_flags_are_refused_before_anything_starts(argv, message, capsys):
    assert message in refusal(argv, capsys)


def test_a_certificate_that_does_not_load_is_refused_at_once(tmp_path, capsys):
    (tmp_path / "key.pem").write_text("not a key")
    (tmp_path / "cert.pem").write_text("not a certificate")
    argv = ["--ssl-keyfile", str(tmp_path / "key.pem"), "--ssl-certfile"]
    err = refusal([*argv, str(tmp_path / "cert.pem")], capsys)
    assert re.search(r"TLS \(--ssl-keyfile .*key\.pem.*\): ", err)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"enable_auto_tool_choice": True}, "--enable-auto-tool-choice needs --tool-call-parser"),
        ({"override_generation_config": {"seed": 1}}, "'seed' is not a sampling default"),
        ({"override_generation_config": {"temperature": -1}}, "temperature must be"),
        ({"override_generation_config": {"top_p": "x"}}, "top_p must be a number"),
        ({"tokenizer_revision": "main"}, "--tokenizer-revision needs --tokenizer"),
        ({"max_logprobs": -2}, "max_logprobs must be in [0, 2048] (the vocabulary) or -1"),
    ],
)
def test_engine_arguments_that_cannot_run_are_config_errors(tiny_model_dir, kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        EngineArgs(model=str(tiny_model_dir), **kwargs).create_engine_config()


def test_auto_tool_choice_keeps_vllms_contract(tiny_model_dir):
    """A parser alone leaves "auto" off (vLLM: it needs --enable-auto-tool-choice as well);
    required and named choices need neither."""
    alone = EngineArgs(model=str(tiny_model_dir), tool_call_parser="hermes")
    assert alone.create_engine_config().model.tool_call_parser is None
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    }
    with pytest.raises(ApiError, match="--enable-auto-tool-choice and --tool-call-parser"):
        chat_tools(decode_body(json.dumps(body).encode(), ChatCompletionRequest), None)
    required = json.dumps({**body, "tool_choice": "required"}).encode()
    assert chat_tools(decode_body(required, ChatCompletionRequest), None).mode == "required"


def test_a_tokenizer_of_its_own_and_an_inline_chat_template(tiny_model_dir, tmp_path):
    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tokenizer / name).write_bytes((tiny_model_dir / name).read_bytes())
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    args = EngineArgs(model=str(tiny_model_dir), tokenizer=str(tokenizer), chat_template=template)
    model = args.create_engine_config().model
    assert model.tokenizer_dir == str(tokenizer) and model.chat_template == template
    same = EngineArgs(model=str(tiny_model_dir), tokenizer=str(tiny_model_dir))
    assert same.create_engine_config().model.tokenizer is None


def test_a_refused_flag_exits_2_before_anything_starts():
    result = subprocess.run(
        [*CONVEYOR, "serve", "/nonexistent", "--enable-lora", "--fully-sharded-loras"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "--fully-sharded-loras: refused" in result.stderr


def test_lora_modules_without_enable_lora_exit_2():
    result = subprocess.run(
        [*CONVEYOR, "serve", "/nonexistent", "--lora-modules", "a=/b"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2 and "--lora-modules" in result.stderr
    assert "--enable-lora" in result.stderr
