"""vLLM's serve flags that conveyor has no option of its own for: accepted where they change
nothing here, refused by name (with the nearest conveyor option) where they would.

Runs wherever a conveyor command parses its flags (``conveyor serve``, ``conveyor frontend``,
``conveyor generate``, ``conveyor bench offline``). The flags vLLM shares with conveyor are
conveyor's own options, spelled as vLLM spells them (``frontend.engine_args``,
``frontend.server.main``, ``entrypoints.serve``); this table holds the others, so that a command
line copied from vLLM's documentation either runs with the same meaning or stops at once saying
which flag, why, and what to use instead, never with a bare "unrecognized arguments". A refused
flag stops the parse at the first one met (exit 2, argparse's usage line); one accepted with no
effect is remembered in the namespace (``NO_EFFECT_DEST``) for the caller to log.
"""

from __future__ import annotations

import argparse
import difflib
from argparse import SUPPRESS
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

# Where the accepted-but-ignored flags of a parse are listed: (flag, why) pairs.
NO_EFFECT_DEST = "vllm_flags_without_effect"

# nargs of the flags below: a switch, one value, one value or none, one or more values.
SWITCH, VALUE, OPTIONAL, VALUES = 0, None, "?", "+"


@dataclass(frozen=True)
class VllmFlag:
    """One vLLM flag conveyor has no option for: accepted and changing nothing (``why`` says
    why), or ``refused`` (``why`` says what conveyor lacks and the nearest option) unless its
    value is one of ``same_as_conveyor``, what conveyor always does ("": given without one)."""

    names: tuple[str, ...]
    nargs: int | str | None
    why: str
    refused: bool = False
    same_as_conveyor: tuple[str, ...] = ()


def _no_effect(names: str, nargs: int | str | None, why: str) -> VllmFlag:
    return VllmFlag(tuple(names.split()), nargs, why)


def _refused(names: str, nargs: int | str | None, why: str, *same: str) -> VllmFlag:
    return VllmFlag(tuple(names.split()), nargs, why, refused=True, same_as_conveyor=same)


_CUDA_GRAPHS = (
    "conveyor captures CUDA graphs for batch sizes 1, 2, 4 and every multiple of 8 up to "
    "--max-num-seqs (at most 512); --enforce-eager turns them off"
)
_NO_COMPILE = (
    "conveyor does not use torch.compile (its CUDA kernels are Triton's, its decode steps CUDA "
    "graphs: --enforce-eager turns those off)"
)
_OLD_SPEC = (
    "vLLM V1 replaced these with --speculative-config; conveyor takes that one "
    '(\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or '
    '\'{"method": "draft_model", "model": DIR, "num_speculative_tokens": 4}\')'
)
_NO_LORA_VOCAB = "conveyor's LoRA adapters never extend the vocabulary (no embedding LoRA)"
_NO_FULLY_SHARDED = (
    "conveyor shards LoRA slots like the layers they adapt; it has no other sharding of them"
)
_TEXT_ONLY = "conveyor serves text-only language models (no images, audio or video)"
_OWN_CONFIG = (
    "conveyor reads the model's config.json as it is; edit a copy of the model directory instead"
)
_NO_EXPERT_PARALLEL = (
    "conveyor has no expert parallelism: mixture-of-experts layers are split by "
    "--tensor-parallel-size (-tp) like the others"
)
_NO_DISAGG = "conveyor has no disaggregated prefill/decode or KV transfer between servers"

# Flags of vLLM's engine arguments: every command that takes engine flags gets these.
ENGINE_FLAGS: tuple[VllmFlag, ...] = (
    _no_effect(
        "--trust-remote-code --no-trust-remote-code",
        SWITCH,
        "conveyor runs its own implementation of each architecture it supports and loads "
        "tokenizers without custom code: no code from a model repository ever runs",
    ),
    _no_effect("--code-revision", VALUE, "no code from a model repository ever runs"),
    _refused(
        "--enable-chunked-prefill",
        OPTIONAL,
        "conveyor always chunks prompts to the step's token budget (policy stall-free); for "
        "whole prompts choose --policy prefill-first or orca",
        "",
        "true",
        "True",
    ),
    _refused(
        "--no-enable-chunked-prefill",
        SWITCH,
        "conveyor always chunks prompts to the step's token budget under its default policy; "
        "the nearest to whole-prompt scheduling is --policy prefill-first (or orca)",
    ),
    _no_effect("--disable-cascade-attn", SWITCH, "conveyor has no cascade attention"),
    _no_effect(
        "--disable-custom-all-reduce",
        SWITCH,
        "conveyor's all-reduce is torch.distributed's (gloo on CPU, NCCL on CUDA)",
    ),
    _no_effect("--max-parallel-loading-workers", VALUE, "each rank loads its own shard"),
    _no_effect("--swap-space", VALUE, "a preempted request is recomputed, never swapped"),
    _refused("--preemption-mode", VALUE, "a preempted request is recomputed", "recompute"),
    _no_effect("--max-seq-len-to-capture --max-cudagraph-capture-size", VALUE, _CUDA_GRAPHS),
    _no_effect("--cuda-graph-sizes --cudagraph-capture-sizes", VALUES, _CUDA_GRAPHS),
    _no_effect("--compilation-config -cc -O --optimization-level", VALUE, _NO_COMPILE),
    _no_effect(
        "--guided-decoding-backend --structured-outputs-config",
        VALUE,
        "structured outputs always run on llguidance, which takes every constraint conveyor "
        "accepts",
    ),
    _no_effect(
        "--prefix-caching-hash-algo", VALUE, "conveyor keys its KV blocks with keyed BLAKE2b"
    ),
    _no_effect("--use-tqdm-on-load --no-use-tqdm-on-load", SWITCH, "loading logs no bar"),
    _no_effect("--safetensors-load-strategy", VALUE, "safetensors files are memory-mapped"),
    _no_effect("--language-model-only", SWITCH, _TEXT_ONLY),
    _no_effect(
        "--show-hidden-metrics-for-version", VALUE, "/metrics shows every series conveyor has"
    ),
    _refused(
        "--load-format",
        VALUE,
        "conveyor loads safetensors checkpoints only (test models with random weights: "
        "python -m benchmarks make-model)",
        "auto",
        "safetensors",
    ),
    _refused(
        "--tokenizer-mode",
        VALUE,
        "conveyor loads the model's Hugging Face tokenizer (fast where there is one)",
        "auto",
        "hf",
    ),
    _refused("--config-format", VALUE, "conveyor reads Hugging Face config.json", "auto", "hf"),
    _refused(
        "--model-impl",
        VALUE,
        "conveyor runs its own implementation of each architecture (docs/models.md)",
        "auto",
        "vllm",
    ),
    _refused(
        "--task --runner",
        VALUE,
        "conveyor generates text only (no embedding, scoring or classification)",
        "auto",
        "generate",
    ),
    _refused("--convert", VALUE, "conveyor generates text only", "auto", "none"),
    _refused(
        "--logprobs-mode",
        VALUE,
        "conveyor's logprobs are the model's raw ones (before temperature, penalties and filters)",
        "raw_logprobs",
    ),
    _refused(
        "--pipeline-parallel-size -pp",
        VALUE,
        "conveyor has no pipeline parallelism; the nearest is --tensor-parallel-size (-tp), "
        "across hosts too with --nnodes",
        "1",
    ),
    _refused(
        "--data-parallel-backend -dpb",
        VALUE,
        "data-parallel engines run as processes; with --distributed-executor-backend ray they "
        "(and their ranks) are placed as Ray actors",
        "mp",
    ),
    _refused(
        "--data-parallel-hybrid-lb -dph --data-parallel-external-lb -dpe "
        "--data-parallel-multi-port-external-lb -dpm",
        SWITCH,
        "every conveyor frontend routes over all the data-parallel engines (--router); engines "
        "on other hosts: --headless --data-parallel-start-rank with --data-parallel-size-local",
    ),
    _refused(
        "--data-parallel-rank -dpn",
        VALUE,
        "conveyor has no external load-balancer mode; engines on other hosts: --headless "
        "--data-parallel-start-rank R",
    ),
    _refused("--enable-expert-parallel -ep --enable-eplb", SWITCH, _NO_EXPERT_PARALLEL),
    _refused("--eplb-config --expert-placement-strategy", VALUE, _NO_EXPERT_PARALLEL),
    _refused("--lora-extra-vocab-size", VALUE, _NO_LORA_VOCAB),
    _refused("--fully-sharded-loras", SWITCH, _NO_FULLY_SHARDED),
    _refused(
        "--speculative-model --num-speculative-tokens --spec-method --spec-model --spec-tokens",
        VALUE,
        _OLD_SPEC,
    ),
    _refused(
        "--cpu-offload-gb",
        VALUE,
        "conveyor keeps every weight on the device; the nearest is --quantization int8 (CPU): a "
        "quarter of float32's weight memory",
        "0",
    ),
    _refused(
        "--kv-offloading-size --kv-offloading-backend",
        VALUE,
        "conveyor keeps the KV cache on the device; size it with --kv-cache-memory-bytes",
    ),
    _refused(
        "--num-gpu-blocks-override",
        VALUE,
        "conveyor sizes the KV cache in bytes: the nearest is --kv-cache-memory-bytes (blocks "
        "of --block-size tokens)",
    ),
    _refused("--enable-sleep-mode", SWITCH, "conveyor has no sleep mode"),
    _refused("--rope-scaling --rope-theta --hf-overrides --hf-config-path", VALUE, _OWN_CONFIG),
    _refused(
        "--hf-token",
        OPTIONAL,
        "conveyor reads a Hugging Face token from $HF_TOKEN (or huggingface_hub's login), never "
        "from a command line, which every local user can read",
    ),
    _refused(
        "--disable-sliding-window",
        SWITCH,
        "conveyor runs a model's sliding windows as its config.json sets them; to cap the "
        "context use --max-model-len",
    ),
    _refused(
        "--limit-mm-per-prompt --mm-processor-kwargs --mm-processor-cache-gb "
        "--allowed-local-media-path --allowed-media-domains --media-io-kwargs",
        VALUE,
        _TEXT_ONLY,
    ),
    _refused(
        "--skip-tokenizer-init",
        SWITCH,
        "the frontends always tokenize; send prompts as token ids to skip their tokenizing",
    ),
    _refused("--enable-prompt-embeds", SWITCH, "prompts are text or token ids"),
    _refused("--kv-transfer-config --kv-events-config --ec-transfer-config", VALUE, _NO_DISAGG),
    _refused(
        "--otlp-traces-endpoint --collect-detailed-traces",
        VALUE,
        "conveyor exports no OpenTelemetry traces; the nearest are /metrics and --trace-steps FILE",
    ),
    _refused(
        "--reasoning-parser-plugin",
        VALUE,
        "conveyor's reasoning parsers are built in: --reasoning-parser NAME",
    ),
    _refused("--calculate-kv-scales", SWITCH, "conveyor has no fp8 KV cache"),
    _refused(
        "--worker-cls --worker-extension-cls --scheduler-cls",
        VALUE,
        "conveyor loads no classes named on the command line; scheduling policies: --policy",
    ),
    _refused(
        "--max-num-partial-prefills --max-long-partial-prefills",
        VALUE,
        "the nearest is --long-prefill-token-threshold (a cap on one prompt's chunk per step)",
        "1",
    ),
    _refused(
        "--stream-interval",
        VALUE,
        "conveyor streams every step's tokens as they come",
        "1",
    ),
    _refused("--enable-return-routed-experts", SWITCH, "conveyor returns no expert routing"),
)

# Flags of vLLM's OpenAI-compatible server: the commands that run HTTP frontends get these.
SERVER_FLAGS: tuple[VllmFlag, ...] = (
    _no_effect(
        "--disable-log-requests",
        SWITCH,
        "conveyor logs no request unless --enable-log-requests",
    ),
    _no_effect(
        "--disable-uvicorn-access-log",
        SWITCH,
        "the access log is off unless --enable-access-log",
    ),
    _no_effect(
        "--disable-fastapi-docs",
        SWITCH,
        "/openapi.json and /docs are always served (they describe the API and nothing else); "
        "there is no /redoc",
    ),
    _no_effect(
        "--disable-frontend-multiprocessing",
        SWITCH,
        "conveyor's frontends are always processes of their own (--frontends / --api-server-count)",
    ),
    _no_effect(
        "--max-log-len",
        VALUE,
        "--enable-log-requests lines are bounded as they are (8 KiB; with --log-prompts the "
        "first 4 prompts, cut at 1,024 characters)",
    ),
    _no_effect(
        "--h11-max-incomplete-event-size --h11-max-header-count",
        VALUE,
        "conveyor caps headers with --max-header-bytes (and 100 headers), bodies with "
        "--max-request-body-bytes",
    ),
    _no_effect(
        "--exclude-tools-when-tool-choice-none",
        SWITCH,
        'conveyor never writes tools into the prompt of a request with tool_choice "none"',
    ),
    _no_effect("--log-error-stack", SWITCH, "an unexpected error's traceback is always logged"),
    _refused(
        "--enable-log-outputs",
        SWITCH,
        "--enable-log-requests logs each request's end (finish reasons, token counts, "
        "latencies), never its text",
    ),
    _refused("--uds", VALUE, "conveyor listens on TCP only: --host and --port"),
    _refused("--middleware", VALUE, "conveyor loads no middleware named on the command line"),
    _refused(
        "--response-role",
        VALUE,
        'chat responses take the role "assistant"',
        "assistant",
    ),
    _refused(
        "--return-tokens-as-token-ids",
        SWITCH,
        "logprobs name tokens by their text; the nearest is requesting the ids themselves "
        "(return_token_ids)",
    ),
    _refused(
        "--enable-prompt-tokens-details",
        SWITCH,
        "usage carries no prompt_tokens_details; cached-prefix hits are in /metrics",
    ),
    _refused(
        "--enable-force-include-usage",
        SWITCH,
        'streams carry usage when a request asks (stream_options {"include_usage": true})',
    ),
    _no_effect(
        "--enable-server-load-tracking",
        SWITCH,
        "GET /load always answers (the generation requests in flight in the frontend that "
        "answers; /metrics has the whole server's)",
    ),
    _refused(
        "--tool-parser-plugin --tool-server",
        VALUE,
        "conveyor's tool-call parsers are built in: --tool-call-parser NAME",
    ),
    _refused(
        "--chat-template-content-format",
        VALUE,
        "conveyor hands the chat template each message's content as one string (its text parts "
        "joined): vLLM's string format",
        "auto",
        "string",
    ),
    _refused(
        "--default-chat-template-kwargs",
        VALUE,
        "the nearest is chat_template_kwargs in each request, or a --chat-template of your own",
    ),
    _refused(
        "--trust-request-chat-template",
        SWITCH,
        "conveyor renders every chat with the server's chat template",
    ),
    _refused(
        "--log-config-file",
        VALUE,
        "conveyor logs in its own format; the level is --log-level (or $CONVEYOR_LOG_LEVEL) and "
        "--uvicorn-log-level",
    ),
    _refused("--enable-ssl-refresh", SWITCH, "restart conveyor serve to load new certificates"),
    _refused("--grpc", SWITCH, "conveyor serves HTTP only"),
    _refused("--tokens-only", SWITCH, "conveyor serves the whole OpenAI-compatible API"),
    _no_effect(
        "--enable-tokenizer-info-endpoint",
        SWITCH,
        "GET /tokenizer_info is always served (behind the API key, if there is one)",
    ),
    _no_effect(
        "--enable-offline-docs",
        SWITCH,
        "/docs is always offline: a page made by the server itself, nothing loaded from a CDN",
    ),
)


class _VllmFlagAction(argparse.Action):
    """Refuse the flag (naming it, why, and the nearest option) or note that it changes
    nothing."""

    def __init__(self, option_strings: Sequence[str], dest: str, flag: VllmFlag, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.flag = flag

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        flag, name = self.flag, option_string or self.flag.names[0]
        given = values if isinstance(values, str) else None
        if flag.refused and (given or "") not in flag.same_as_conveyor:
            shown = f"{name} {given}" if given is not None else name
            parser.error(
                f"{shown}: refused, conveyor lacks what this vLLM flag asks for: {flag.why}"
            )
        noted = list(getattr(namespace, NO_EFFECT_DEST, None) or [])
        noted.append((name, flag.why))
        setattr(namespace, NO_EFFECT_DEST, noted)


def add_vllm_flags(parser: argparse._ActionsContainer, flags: Sequence[VllmFlag]) -> None:
    """Add ``flags`` (hidden from --help: docs/serving.md has the table)."""
    for flag in flags:
        parser.add_argument(
            *flag.names,
            dest=f"vllm_{flag.names[0].lstrip('-').replace('-', '_')}",
            nargs=flag.nargs,
            action=_VllmFlagAction,
            flag=flag,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def flags_without_effect(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The (flag, why) pairs of the vLLM flags given that change nothing here."""
    return list(getattr(args, NO_EFFECT_DEST, None) or [])


class FlagParser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of an unknown flag names the closest known ones."""

    def error(self, message: str) -> NoReturn:
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            known = [o for a in self._actions for o in a.option_strings if a.help != SUPPRESS]
            for arg in message[len(prefix) :].split():
                name = arg.partition("=")[0]
                close = difflib.get_close_matches(name, known, n=3) if name.startswith("-") else []
                if close:
                    message += f" ({name}: did you mean {' or '.join(close)}?)"
            message += f"; {self.prog} --help lists every flag"
        super().error(message)


def normalize_vllm_argv(argv: Sequence[str]) -> list[str]:
    """vLLM's parser takes ``--max_model_len`` for ``--max-model-len``; so does this one. Only
    the option's name changes, never a value."""
    normalized = []
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        normalized.append(arg)
    return normalized
