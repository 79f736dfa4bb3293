"""Protobuf <-> the roles' types, in both directions, for both sides of every RPC.

Parsing functions raise ValueError with a readable reason; the servicer maps
it to INVALID_ARGUMENT.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from typing import Any

from disagg.proto import disagg_pd_pb2 as pb, xllm_service_pb2
from disagg.proto.vocabulary import cluster_id, rank0_transfer_address
from disagg.workers.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from disagg.workers.engine.sampling_params import SamplingParams
from disagg.workers.pd.messages import Admission, FirstToken, NewRequest, Reservation, TransferMode

# --- sampling parameters ------------------------------------------------------

_MAX_TOP_K = 1 << 31


def request_to_proto(req: NewRequest) -> pb.DisaggRequest:
    p = req.params
    return pb.DisaggRequest(
        req_id=req.req_id, service_req_id=req.req_id, tokens_num=len(req.prompt_token_ids),
        prompt_tokens=req.prompt_token_ids, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos,
        stop_token_ids=list(p.stop_token_ids), n=1, frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty, repetition_penalty=p.repetition_penalty,
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, logprobs=p.logprobs is not None,
        top_logprobs=p.logprobs or 0, skip_special_tokens=p.skip_special_tokens,
        source_xservice_addr=req.source_addr,
    )


def request_from_proto(msg: pb.DisaggRequest) -> NewRequest:
    """ValueError for a request that cannot be built."""
    if not msg.req_id:
        raise ValueError("req_id is empty")
    if not msg.prompt_tokens:
        raise ValueError(f"request {msg.req_id}: prompt_tokens is empty")
    if msg.n > 1:
        raise ValueError(f"request {msg.req_id}: n={msg.n}; a decode runs one sequence per request")
    if msg.stop_sequences:
        raise ValueError(f"request {msg.req_id}: stop_sequences are not supported; send stop_token_ids")
    if any(t < 0 for t in msg.stop_token_ids):
        raise ValueError(f"request {msg.req_id}: negative stop_token_ids {[t for t in msg.stop_token_ids if t < 0][:5]}")
    # NOTE: the sampler keeps top_k in an int64 tensor: a huge one would fail the whole batch's step.
    if not -1 <= msg.top_k < _MAX_TOP_K:
        raise ValueError(f"request {msg.req_id}: top_k {msg.top_k} is outside [-1, {_MAX_TOP_K})")
    # proto3 leaves default-valued fields out: 0 means "not set" where 0 is invalid.
    params = SamplingParams(
        max_tokens=msg.max_tokens or 16, temperature=msg.temperature, top_p=msg.top_p or 1.0,
        top_k=int(msg.top_k), presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0, stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos, logprobs=int(msg.top_logprobs) if msg.logprobs else None,
        skip_special_tokens=msg.skip_special_tokens,
    )
    return NewRequest(msg.req_id, list(msg.prompt_tokens), params, msg.source_xservice_addr)


# The services' wire names (in traces): xllm.proto.DisaggPDService, xllm_service.proto.XllmRpcService.
PD_SERVICE = pb.DESCRIPTOR.services_by_name["DisaggPDService"].full_name
XLLM_SERVICE = xllm_service_pb2.DESCRIPTOR.services_by_name["XllmRpcService"].full_name

# The sampling fields DisaggRequest has no field for travel as gRPC metadata of
# AddNewRequests: JSON {req_id: {field: value}}, only for requests that set one.
# A decode that does not read it (xLLM's) samples without them.
SAMPLING_EXTRAS_KEY = "x-disagg-sampling-extras"
# Our extension of xLLM's request (an xLLM peer ignores metadata): sampling fields
# its protobuf lacks, the structured-output grammar among them (docs/openai-api.md),
# and the tokens a migrated stream already made (docs/pd-wire.md).
_EXTRA_DEFAULTS: dict[str, object] = {"seed": None, "min_p": 0.0, "grammar": None, "draws_made": 0,
                                      "logit_bias": (), "min_tokens": 0}


# gRPC refuses a call whose metadata passes the receiver's limit (8 KiB soft, 16 KiB hard by
# default), and a grammar (a big schema, many tools) easily does: our servers and channels take
# up to METADATA_LIMIT_BYTES, and the extras of one AddNewRequests call may use all of it but
# MAX_EXTRAS_BYTES' room for the other headers (auth, path, deadline: well under 1 KiB).
METADATA_LIMIT_BYTES = 1 << 20
MAX_EXTRAS_BYTES = METADATA_LIMIT_BYTES - (8 << 10)
METADATA_OPTIONS = (("grpc.max_metadata_size", METADATA_LIMIT_BYTES),
                    ("grpc.absolute_max_metadata_size", METADATA_LIMIT_BYTES))
# What a migration adds to a request's extras: the wire id's "~n" and a longer draws_made.
_MIGRATION_ROOM = 64


def _extras(params: SamplingParams) -> dict[str, object]:
    return {name: value for name, default in _EXTRA_DEFAULTS.items() if (value := getattr(params, name)) != default}


def sampling_extras_metadata(reqs: Sequence[NewRequest]) -> tuple[tuple[str, str], ...]:
    """The call's extras entry (none when no request has one); ValueError when it passes MAX_EXTRAS_BYTES."""
    extras = {r.req_id: fields for r in reqs if (fields := _extras(r.params))}
    if not extras:
        return ()
    value = json.dumps(extras)
    if len(value) > MAX_EXTRAS_BYTES:
        raise ValueError(f"the sampling extras (grammar, seed) of {len(reqs)} requests take {len(value)} bytes, "
                         f"over the {MAX_EXTRAS_BYTES} bytes of gRPC metadata a hand-off carries")
    return ((SAMPLING_EXTRAS_KEY, value),)


def extras_fit(req_id: str, params: SamplingParams) -> bool:
    """Whether one request's extras fit an AddNewRequests call alone, also after migrations."""
    return len(json.dumps({req_id: _extras(params)})) + _MIGRATION_ROOM <= MAX_EXTRAS_BYTES


def _per_request(metadata: Iterable[tuple[str, str | bytes]], key: str, what: str) -> dict[str, Any] | None:
    """The JSON object `{req_id: ...}` under `key` in `metadata`; None when absent; ValueError when malformed."""
    raw = next((value for k, value in metadata if k == key), None)
    if raw is None:
        return None
    try:
        found = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{key} is not JSON: {exc}") from None
    if not isinstance(found, dict):
        raise ValueError(f"{key} must map request ids to {what}")
    return found


def with_sampling_extras(reqs: list[NewRequest], metadata: Iterable[tuple[str, str | bytes]]) -> list[NewRequest]:
    """`reqs` with the extras of `sampling_extras_metadata` applied; ValueError for a malformed entry."""
    extras = _per_request(metadata, SAMPLING_EXTRAS_KEY, "fields")
    if extras is None:
        return reqs
    out = []
    for r in reqs:
        fields = extras.get(r.req_id, {})
        if not isinstance(fields, dict) or not set(fields) <= set(_EXTRA_DEFAULTS):
            raise ValueError(f"{SAMPLING_EXTRAS_KEY} of {r.req_id}: fields must be among {sorted(_EXTRA_DEFAULTS)}")
        seed, min_p, grammar = fields.get("seed"), fields.get("min_p", 0.0), fields.get("grammar")
        draws, min_tokens = fields.get("draws_made", 0), fields.get("min_tokens", 0)
        if (not (seed is None or type(seed) is int) or type(min_p) not in (int, float) or type(draws) is not int
                or type(min_tokens) is not int):
            raise ValueError(f"{SAMPLING_EXTRAS_KEY} of {r.req_id}: seed, draws_made and min_tokens must be "
                             "integers, min_p a number")
        if not (grammar is None or isinstance(grammar, str)):
            raise ValueError(f"{SAMPLING_EXTRAS_KEY} of {r.req_id}: grammar must be a string")
        try:
            params = dataclasses.replace(r.params, seed=seed, min_p=float(min_p), grammar=grammar, draws_made=draws,
                                         min_tokens=min_tokens,
                                         logit_bias=_logit_bias(fields.get("logit_bias", ()), r.req_id))
        except ValueError as exc:
            raise ValueError(f"{SAMPLING_EXTRAS_KEY} of {r.req_id}: {exc}") from None
        out.append(dataclasses.replace(r, params=params))
    return out


def _logit_bias(pairs: object, req_id: str) -> tuple[tuple[int, float], ...]:
    """The extras' `logit_bias`: [[token id, value], ...] (SamplingParams checks the ranges)."""
    if not isinstance(pairs, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and type(p[0]) is int and type(p[1]) in (int, float)
            for p in pairs):
        raise ValueError(f"{SAMPLING_EXTRAS_KEY} of {req_id}: logit_bias must be [[token id, number], ...]")
    return tuple((int(t), float(v)) for t, v in pairs)


def reservation_to_proto(r: Reservation) -> pb.DisaggResponse:
    return pb.DisaggResponse(req_id=r.req_id, status_code=int(r.status), blocks_ids=r.block_ids, dp_rank=0)


def reservation_from_proto(msg: pb.DisaggResponse) -> Reservation:
    try:
        status = Admission(msg.status_code)
    except ValueError:
        status = Admission.REFUSED  # an unknown code is a refusal, never a success
    return Reservation(msg.req_id, status, list(msg.blocks_ids))


# --- the first token ------------------------------------------------------------


def first_token_to_proto(ft: FirstToken) -> pb.DisaggGenerationsRequest:
    token = pb.RemoteToken(token_id=ft.token_id, time_to_first_token_latency_seconds=ft.ttft_s)
    if ft.logprob is not None:
        token.has_logprob = True
        token.logprob = ft.logprob.logprob
        token.top_tokens.extend(t for t, _ in ft.logprob.top)
        token.top_logprobs.extend(v for _, v in ft.logprob.top)
    msg = pb.DisaggGenerationsRequest(req_id=ft.req_id, tokens=[token], kv_cache_transfer_mode=ft.mode.value,
                                      dp_size=1, dp_rank=0)
    if ft.mode is TransferMode.PULL:
        msg.addrs.append(ft.prefill_transfer_address)
        msg.cluster_ids.append(cluster_id(ft.prefill_transfer_address))
        msg.block_ids.extend(ft.prefill_block_ids)
    return msg


def first_token_from_proto(msg: pb.DisaggGenerationsRequest) -> FirstToken:
    """ValueError for a malformed message (the request itself may still be known)."""
    if len(msg.tokens) != 1:
        raise ValueError(f"request {msg.req_id}: FirstGeneration carries {len(msg.tokens)} tokens, not 1")
    try:
        mode = TransferMode(msg.kv_cache_transfer_mode or TransferMode.PUSH.value)
    except ValueError:
        raise ValueError(f"request {msg.req_id}: unknown kv_cache_transfer_mode {msg.kv_cache_transfer_mode!r}") from None
    token = msg.tokens[0]
    logprob = None
    if token.has_logprob:
        logprob = TokenLogprob(int(token.token_id), token.logprob, tuple(zip(map(int, token.top_tokens), token.top_logprobs)))
    address = ""  # PUSH: the decode reads nothing from the prefill
    if mode is TransferMode.PULL:
        found = rank0_transfer_address(msg.addrs, msg.cluster_ids)
        if found is None:
            raise ValueError(f"request {msg.req_id}: PULL needs the prefill's addrs or cluster_ids")
        address = found
    return FirstToken(msg.req_id, int(token.token_id), logprob, mode, token.time_to_first_token_latency_seconds,
                      address, tuple(msg.block_ids))


# --- the token stream -----------------------------------------------------------


def output_to_proto(out: RequestOutput) -> pb.DisaggStreamGeneration:
    seq = pb.SequenceOutput(index=0, text=out.new_text, token_ids=out.new_token_ids,
                            finish_reason=out.finish_reason.value if out.finish_reason else "")
    for lp in out.new_logprobs or ():
        seq.logprobs.append(pb.LogProb(
            log_prob_data=pb.LogProbData(token_id=lp.token_id, logprob=lp.logprob),
            top_logprobs=[pb.LogProbData(token_id=t, logprob=v) for t, v in lp.top],
        ))
    gen = pb.DisaggStreamGeneration(req_id=out.request_id, service_req_id=out.request_id, outputs=[seq],
                                    finished=out.finished, gen_status=pb.GenerationStatus(status_code=200))
    if out.finished:
        gen.usage.CopyFrom(pb.OutputUsage(num_prompt_tokens=out.num_prompt_tokens,
                                          num_generated_tokens=out.num_output_tokens,
                                          num_total_tokens=out.num_prompt_tokens + out.num_output_tokens))
    return gen


def output_from_proto(gen: pb.DisaggStreamGeneration) -> RequestOutput:
    """ValueError for an unknown finish reason, or logprobs that do not match the tokens one for one."""
    token_ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    finish_reason: FinishReason | None = None
    for seq in gen.outputs:
        token_ids.extend(seq.token_ids)
        for lp in seq.logprobs:
            top = tuple((d.token_id, d.logprob) for d in lp.top_logprobs)
            logprobs.append(TokenLogprob(lp.log_prob_data.token_id, lp.log_prob_data.logprob, top))
        if seq.finish_reason:
            try:
                finish_reason = FinishReason(seq.finish_reason)
            except ValueError:
                raise ValueError(f"request {gen.req_id}: unknown finish_reason {seq.finish_reason!r}") from None
    if logprobs and len(logprobs) != len(token_ids):
        raise ValueError(f"request {gen.req_id}: {len(logprobs)} logprobs for {len(token_ids)} tokens")
    if gen.gen_status.status_code not in (0, 200):
        finish_reason = FinishReason.ABORT
    return RequestOutput(
        request_id=gen.req_id, new_token_ids=token_ids, new_text="", finished=gen.finished,
        finish_reason=finish_reason if gen.finished else None, num_prompt_tokens=gen.usage.num_prompt_tokens,
        num_output_tokens=gen.usage.num_generated_tokens, new_logprobs=logprobs or None,
    )


# Decode-side prefix reuse (docs/pd-wire.md). Our prefill says on AddNewRequests that it
# can skip the blocks a decode already holds; only then may our decode share its cached
# prefix blocks, and it names their count per request in the answer's trailing metadata.
# An xLLM prefill sends no such flag and gets fresh blocks for the whole prompt, as before;
# an xLLM decode sends no counts and gets the whole prompt's KV, as before.
PREFIX_REUSE_KEY = "x-disagg-prefix-reuse"
CACHED_BLOCKS_KEY = "x-disagg-cached-blocks"
PREFIX_REUSE_METADATA = ((PREFIX_REUSE_KEY, "1"),)


def wants_prefix_reuse(metadata: Iterable[tuple[str, str | bytes]]) -> bool:
    return any(key == PREFIX_REUSE_KEY and value == "1" for key, value in metadata)


def cached_blocks_metadata(reservations: Sequence[Reservation]) -> tuple[tuple[str, str], ...]:
    counts = {r.req_id: r.num_cached_blocks for r in reservations if r.num_cached_blocks}
    return ((CACHED_BLOCKS_KEY, json.dumps(counts)),) if counts else ()


def with_cached_blocks(reservations: list[Reservation],
                       metadata: Iterable[tuple[str, str | bytes]]) -> list[Reservation]:
    """`reservations` with the counts of `cached_blocks_metadata`; ValueError for a malformed or impossible one."""
    counts = _per_request(metadata, CACHED_BLOCKS_KEY, "block counts")
    if counts is None:
        return reservations
    out = []
    for r in reservations:
        count = counts.get(r.req_id, 0)
        if type(count) is not int or not 0 <= count < max(len(r.block_ids), 1):
            raise ValueError(f"{CACHED_BLOCKS_KEY} of {r.req_id}: {count!r} is not a count below its "
                             f"{len(r.block_ids)} blocks")
        out.append(dataclasses.replace(r, num_cached_blocks=count))
    return out
