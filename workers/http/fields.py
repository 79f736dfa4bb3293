"""What the server does with request fields it does not implement: nothing is
silently ignored (issue 16). A field that `protocol.py` does not declare is
either accepted as harmless (it asks for nothing that changes the output), or
refused with a 400 that names it, unless its value asks for nothing (null, or
the value that means "off"). Any other name is refused as unrecognised, as
OpenAI's own API does. docs/openai-api.md lists the same tables for clients.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from disagg.workers.http.errors import BadRequest

# Fields that change nothing about what is generated: bookkeeping, billing,
# routing hints of OpenAI's platform, or options of features that are absent.
HARMLESS: dict[str, str] = {
    "metadata": "stored-completion tags; nothing is stored",
    "store": "OpenAI's stored completions; nothing is stored",
    "service_tier": "OpenAI's billing tier",
    "prompt_cache_key": "a cache-routing hint; the prefix cache works without it",
    "prompt_cache_retention": "OpenAI's cache retention; the prefix cache keeps what fits",
    "prompt_cache_options": "OpenAI's cache breakpoints; the prefix cache finds shared prefixes itself",
    "safety_identifier": "an end-user id for OpenAI's abuse monitoring",
    "request_id": "vLLM's client-chosen id; responses carry the server's id",
    # SGLang's, which sglang-router writes into every request it forwards
    "separate_reasoning": "SGLang's reasoning split, done only by a reasoning parser; this server has none",
    "stream_reasoning": "SGLang's streaming of that split; no reasoning parser here",
    "include_reasoning": "vLLM's switch for a reasoning parser's output; this server has none",
}


# Whether a field's value asks for nothing, given the request it came in.
Noop = Callable[[Any, Any], bool]


def noop_if(*values: Any) -> Noop:
    """A value equal to one of `values` (with the same JSON type) asks for nothing."""
    return lambda value, _req: any(type(value) is type(v) and value == v for v in (None, *values))


def _best_of_noop(value: Any, req: Any) -> bool:  # a completion or chat request
    return value is None or (type(value) is int and value == req.n)


@dataclass(frozen=True)
class Refused:
    reason: str
    noop: Noop = noop_if()


_LEGACY_FUNCTIONS = "the legacy functions API is not supported: use tools and tool_choice"

REFUSED: dict[str, Refused] = {
    # OpenAI
    "functions": Refused(_LEGACY_FUNCTIONS, noop_if([])),
    "function_call": Refused(_LEGACY_FUNCTIONS, noop_if("none")),
    "best_of": Refused("best_of other than n is not supported", _best_of_noop),
    "suffix": Refused("suffix (insertion) is not supported", noop_if("")),
    "audio": Refused("audio output is not supported"),
    "modalities": Refused("only text output is supported", noop_if(["text"])),
    "prediction": Refused("predicted outputs are not supported"),
    "web_search_options": Refused("web search is not supported"),
    "reasoning_effort": Refused("this model has no reasoning mode"),
    "verbosity": Refused("this model has no verbosity control"),
    "moderation": Refused("moderation of input and output is not supported"),
    # vLLM's extensions
    "echo": Refused("echo is supported on /v1/completions only", noop_if(False)),
    "structural_tag": Refused("structural tags are not supported"),
    "guided_decoding_backend": Refused("the structured-output backend is fixed (llguidance)"),
    "guided_whitespace_pattern": Refused("JSON output is compact; its whitespace cannot be chosen"),
    "use_beam_search": Refused("beam search is not supported", noop_if(False)),
    "length_penalty": Refused("length_penalty (beam search) is not supported", noop_if(1.0, 1)),
    "include_stop_str_in_output": Refused("include_stop_str_in_output is not supported", noop_if(False)),
    "spaces_between_special_tokens": Refused("spaces_between_special_tokens is not supported", noop_if(True)),
    "truncate_prompt_tokens": Refused("truncate_prompt_tokens is not supported"),
    "allowed_token_ids": Refused("allowed_token_ids is not supported"),
    "bad_words": Refused("bad_words is not supported", noop_if([])),
    "continue_final_message": Refused("continue_final_message is not supported", noop_if(False)),
    "add_special_tokens": Refused("add_special_tokens is not supported"),
    "chat_template": Refused("a request's own chat_template is not supported"),
    "documents": Refused("documents (RAG templates) are not supported"),
    "mm_processor_kwargs": Refused("multimodal input is not supported"),
    "logits_processors": Refused("logits_processors is not supported"),
    "return_tokens_as_token_ids": Refused("return_tokens_as_token_ids is not supported", noop_if(False)),
    "priority": Refused("request priority is not supported", noop_if(0)),
    "kv_transfer_params": Refused("kv_transfer_params is vLLM's connector API, not this server's"),
    "vllm_xargs": Refused("vllm_xargs is not supported"),
    "cache_salt": Refused("cache_salt is not supported"),
    # SGLang's extensions (sglang-router forwards them with these off values)
    "no_stop_trim": Refused("no_stop_trim is not supported: stop strings are trimmed", noop_if(False)),
    "return_hidden_states": Refused("hidden states are not returned", noop_if(False)),
}


def check_extra_fields(req: BaseModel, harmless: Mapping[str, str] = HARMLESS,
                       refused_fields: Mapping[str, Refused] = REFUSED) -> None:
    """Refuse (400, naming it) each undeclared field that asks for something not done;
    the tables are the completion endpoints' unless an endpoint brings its own."""
    for name, value in (req.model_extra or {}).items():
        if name in harmless:
            continue
        refused = refused_fields.get(name)
        if refused is None:
            raise BadRequest(f"unrecognized request argument supplied: {name}", name)
        if not refused.noop(value, req):
            raise BadRequest(f"{name}: {refused.reason}", name)


# A response message's own fields, which clients replay with it as an assistant
# message (vLLM ignores them too): what the model said is in `content` and `tool_calls`.
MESSAGE_OUTPUT_FIELDS: dict[str, str] = {
    "refusal": "OpenAI's refusal text of a response; this model answers in content",
    "annotations": "OpenAI's URL citations of web search, which is not offered",
    "audio": "OpenAI's audio answer, which this server never gives",
    "parsed": "the openai client's parse() result: content, parsed",
    "reasoning_content": "a reasoning parser's output (vLLM's, SGLang's); this server has none",
    "reasoning": "a reasoning parser's output (vLLM's newer name); this server has none",
}


# Hints a message may carry on any role, which ask for nothing this server does not do already.
MESSAGE_HINT_FIELDS: dict[str, str] = {
    # Anthropic's prompt-caching mark, which LiteLLM, Cline and Roo send on messages and on content
    # parts: the prefix cache keeps every prompt's blocks without being asked.
    "cache_control": "a prompt-caching hint; the prefix cache is automatic",
}


def check_message_fields(index: int, role: str, extra: Mapping[str, Any] | None) -> None:
    """A chat message's undeclared fields: null ones, hints (MESSAGE_HINT_FIELDS) and an
    assistant message's output-only fields (replayed with it) ask for nothing; any other is refused."""
    for name, value in (extra or {}).items():
        replayed = role == "assistant" and name in MESSAGE_OUTPUT_FIELDS
        if not replayed and name not in MESSAGE_HINT_FIELDS and value is not None:
            raise BadRequest(f"messages[{index}].{name} is not supported", "messages")
