from disagg.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClusterInfos(_message.Message):
    __slots__ = ("cluster_ids", "device_ips", "ports", "dp_size", "addrs")
    CLUSTER_IDS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IPS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    cluster_ids: _containers.RepeatedScalarFieldContainer[int]
    device_ips: _containers.RepeatedScalarFieldContainer[str]
    ports: _containers.RepeatedScalarFieldContainer[int]
    dp_size: int
    addrs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cluster_ids: _Optional[_Iterable[int]] = ..., device_ips: _Optional[_Iterable[str]] = ..., ports: _Optional[_Iterable[int]] = ..., dp_size: _Optional[int] = ..., addrs: _Optional[_Iterable[str]] = ...) -> None: ...

class DisaggRequests(_message.Message):
    __slots__ = ("prefill_name", "reqs", "cluster_infos")
    PREFILL_NAME_FIELD_NUMBER: _ClassVar[int]
    REQS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_INFOS_FIELD_NUMBER: _ClassVar[int]
    prefill_name: str
    reqs: _containers.RepeatedCompositeFieldContainer[DisaggRequest]
    cluster_infos: ClusterInfos
    def __init__(self, prefill_name: _Optional[str] = ..., reqs: _Optional[_Iterable[_Union[DisaggRequest, _Mapping]]] = ..., cluster_infos: _Optional[_Union[ClusterInfos, _Mapping]] = ...) -> None: ...

class StopSequence(_message.Message):
    __slots__ = ("seq_tokens",)
    SEQ_TOKENS_FIELD_NUMBER: _ClassVar[int]
    seq_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class DisaggRequest(_message.Message):
    __slots__ = ("req_id", "service_req_id", "tokens_num", "prompt", "stream", "x_request_id", "x_request_time", "max_tokens", "max_context_len", "seq_capacity", "ignore_eos", "eos_token_id", "stop_token_ids", "stop_sequences", "n", "best_of", "frequency_penalty", "presence_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "logprobs", "top_logprobs", "is_embeddings", "echo", "skip_special_tokens", "prompt_tokens", "offline", "ttlt_slo_ms", "priority", "ttft_slo_ms", "tpot_slo_ms", "tpot_priority_weight", "ttft_priority_weight", "ttlt_priority_weight", "priority_weight", "source_xservice_addr")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_NUM_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    X_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    X_REQUEST_TIME_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    SEQ_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    IS_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_FIELD_NUMBER: _ClassVar[int]
    TTLT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TTFT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_SLO_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_PRIORITY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TTFT_PRIORITY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    TTLT_PRIORITY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_XSERVICE_ADDR_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    service_req_id: str
    tokens_num: int
    prompt: str
    stream: bool
    x_request_id: str
    x_request_time: str
    max_tokens: int
    max_context_len: int
    seq_capacity: int
    ignore_eos: bool
    eos_token_id: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_sequences: _containers.RepeatedCompositeFieldContainer[StopSequence]
    n: int
    best_of: int
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    temperature: float
    top_p: float
    top_k: int
    logprobs: bool
    top_logprobs: int
    is_embeddings: bool
    echo: bool
    skip_special_tokens: bool
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    offline: bool
    ttlt_slo_ms: int
    priority: _common_pb2.Priority
    ttft_slo_ms: int
    tpot_slo_ms: int
    tpot_priority_weight: int
    ttft_priority_weight: int
    ttlt_priority_weight: int
    priority_weight: int
    source_xservice_addr: str
    def __init__(self, req_id: _Optional[str] = ..., service_req_id: _Optional[str] = ..., tokens_num: _Optional[int] = ..., prompt: _Optional[str] = ..., stream: _Optional[bool] = ..., x_request_id: _Optional[str] = ..., x_request_time: _Optional[str] = ..., max_tokens: _Optional[int] = ..., max_context_len: _Optional[int] = ..., seq_capacity: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., eos_token_id: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_sequences: _Optional[_Iterable[_Union[StopSequence, _Mapping]]] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., is_embeddings: _Optional[bool] = ..., echo: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., offline: _Optional[bool] = ..., ttlt_slo_ms: _Optional[int] = ..., priority: _Optional[_Union[_common_pb2.Priority, str]] = ..., ttft_slo_ms: _Optional[int] = ..., tpot_slo_ms: _Optional[int] = ..., tpot_priority_weight: _Optional[int] = ..., ttft_priority_weight: _Optional[int] = ..., ttlt_priority_weight: _Optional[int] = ..., priority_weight: _Optional[int] = ..., source_xservice_addr: _Optional[str] = ...) -> None: ...

class DisaggResponses(_message.Message):
    __slots__ = ("resps",)
    RESPS_FIELD_NUMBER: _ClassVar[int]
    resps: _containers.RepeatedCompositeFieldContainer[DisaggResponse]
    def __init__(self, resps: _Optional[_Iterable[_Union[DisaggResponse, _Mapping]]] = ...) -> None: ...

class DisaggResponse(_message.Message):
    __slots__ = ("req_id", "status_code", "blocks_ids", "dp_rank", "xtensor_layer_offsets")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_IDS_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    XTENSOR_LAYER_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    status_code: int
    blocks_ids: _containers.RepeatedScalarFieldContainer[int]
    dp_rank: int
    xtensor_layer_offsets: _containers.RepeatedCompositeFieldContainer[XTensorLayerOffsets]
    def __init__(self, req_id: _Optional[str] = ..., status_code: _Optional[int] = ..., blocks_ids: _Optional[_Iterable[int]] = ..., dp_rank: _Optional[int] = ..., xtensor_layer_offsets: _Optional[_Iterable[_Union[XTensorLayerOffsets, _Mapping]]] = ...) -> None: ...

class XTensorLayerOffsets(_message.Message):
    __slots__ = ("k_offsets", "v_offsets")
    K_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    V_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    k_offsets: _containers.RepeatedScalarFieldContainer[int]
    v_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, k_offsets: _Optional[_Iterable[int]] = ..., v_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class OutputUsage(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_generated_tokens", "num_total_tokens")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_generated_tokens: int
    num_total_tokens: int
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_total_tokens: _Optional[int] = ...) -> None: ...

class LogProbData(_message.Message):
    __slots__ = ("token", "token_id", "logprob", "finished_token")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    FINISHED_TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    token_id: int
    logprob: float
    finished_token: bool
    def __init__(self, token: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., finished_token: _Optional[bool] = ...) -> None: ...

class LogProb(_message.Message):
    __slots__ = ("log_prob_data", "top_logprobs")
    LOG_PROB_DATA_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    log_prob_data: LogProbData
    top_logprobs: _containers.RepeatedCompositeFieldContainer[LogProbData]
    def __init__(self, log_prob_data: _Optional[_Union[LogProbData, _Mapping]] = ..., top_logprobs: _Optional[_Iterable[_Union[LogProbData, _Mapping]]] = ...) -> None: ...

class SequenceOutput(_message.Message):
    __slots__ = ("index", "text", "token_ids", "finish_reason", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    logprobs: _containers.RepeatedCompositeFieldContainer[LogProb]
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[LogProb, _Mapping]]] = ...) -> None: ...

class GenerationStatus(_message.Message):
    __slots__ = ("status_code", "status_msg")
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_MSG_FIELD_NUMBER: _ClassVar[int]
    status_code: int
    status_msg: str
    def __init__(self, status_code: _Optional[int] = ..., status_msg: _Optional[str] = ...) -> None: ...

class DisaggStreamGeneration(_message.Message):
    __slots__ = ("req_id", "service_req_id", "gen_status", "outputs", "usage", "finished", "finished_on_prefill_instance")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_REQ_ID_FIELD_NUMBER: _ClassVar[int]
    GEN_STATUS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_ON_PREFILL_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    service_req_id: str
    gen_status: GenerationStatus
    outputs: _containers.RepeatedCompositeFieldContainer[SequenceOutput]
    usage: OutputUsage
    finished: bool
    finished_on_prefill_instance: bool
    def __init__(self, req_id: _Optional[str] = ..., service_req_id: _Optional[str] = ..., gen_status: _Optional[_Union[GenerationStatus, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[SequenceOutput, _Mapping]]] = ..., usage: _Optional[_Union[OutputUsage, _Mapping]] = ..., finished: _Optional[bool] = ..., finished_on_prefill_instance: _Optional[bool] = ...) -> None: ...

class DisaggStreamGenerations(_message.Message):
    __slots__ = ("gens",)
    GENS_FIELD_NUMBER: _ClassVar[int]
    gens: _containers.RepeatedCompositeFieldContainer[DisaggStreamGeneration]
    def __init__(self, gens: _Optional[_Iterable[_Union[DisaggStreamGeneration, _Mapping]]] = ...) -> None: ...

class StatusSet(_message.Message):
    __slots__ = ("all_status",)
    ALL_STATUS_FIELD_NUMBER: _ClassVar[int]
    all_status: _containers.RepeatedCompositeFieldContainer[_common_pb2.Status]
    def __init__(self, all_status: _Optional[_Iterable[_Union[_common_pb2.Status, _Mapping]]] = ...) -> None: ...

class PullSignal(_message.Message):
    __slots__ = ("source_instance_name", "preferred_req_len", "max_total_len")
    SOURCE_INSTANCE_NAME_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_REQ_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_TOTAL_LEN_FIELD_NUMBER: _ClassVar[int]
    source_instance_name: str
    preferred_req_len: int
    max_total_len: int
    def __init__(self, source_instance_name: _Optional[str] = ..., preferred_req_len: _Optional[int] = ..., max_total_len: _Optional[int] = ...) -> None: ...

class RemoteToken(_message.Message):
    __slots__ = ("token_id", "has_logprob", "logprob", "top_tokens", "top_logprobs", "time_to_first_token_latency_seconds")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_LATENCY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    has_logprob: bool
    logprob: float
    top_tokens: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    time_to_first_token_latency_seconds: float
    def __init__(self, token_id: _Optional[int] = ..., has_logprob: _Optional[bool] = ..., logprob: _Optional[float] = ..., top_tokens: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ..., time_to_first_token_latency_seconds: _Optional[float] = ...) -> None: ...

class DisaggGenerationsRequest(_message.Message):
    __slots__ = ("req_id", "tokens", "kv_cache_transfer_mode", "cluster_ids", "addrs", "k_cache_ids", "v_cache_ids", "block_ids", "dp_size", "dp_rank", "x_request_id", "x_request_time")
    REQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_TRANSFER_MODE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    K_CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    V_CACHE_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    X_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    X_REQUEST_TIME_FIELD_NUMBER: _ClassVar[int]
    req_id: str
    tokens: _containers.RepeatedCompositeFieldContainer[RemoteToken]
    kv_cache_transfer_mode: str
    cluster_ids: _containers.RepeatedScalarFieldContainer[int]
    addrs: _containers.RepeatedScalarFieldContainer[str]
    k_cache_ids: _containers.RepeatedScalarFieldContainer[int]
    v_cache_ids: _containers.RepeatedScalarFieldContainer[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    dp_size: int
    dp_rank: int
    x_request_id: str
    x_request_time: str
    def __init__(self, req_id: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[RemoteToken, _Mapping]]] = ..., kv_cache_transfer_mode: _Optional[str] = ..., cluster_ids: _Optional[_Iterable[int]] = ..., addrs: _Optional[_Iterable[str]] = ..., k_cache_ids: _Optional[_Iterable[int]] = ..., v_cache_ids: _Optional[_Iterable[int]] = ..., block_ids: _Optional[_Iterable[int]] = ..., dp_size: _Optional[int] = ..., dp_rank: _Optional[int] = ..., x_request_id: _Optional[str] = ..., x_request_time: _Optional[str] = ...) -> None: ...

class DisaggGenerationsRequests(_message.Message):
    __slots__ = ("multi_gens",)
    MULTI_GENS_FIELD_NUMBER: _ClassVar[int]
    multi_gens: _containers.RepeatedCompositeFieldContainer[DisaggGenerationsRequest]
    def __init__(self, multi_gens: _Optional[_Iterable[_Union[DisaggGenerationsRequest, _Mapping]]] = ...) -> None: ...

class InstanceClusterInfo(_message.Message):
    __slots__ = ("instance_name", "cluster_ids", "addrs", "device_ips", "ports", "dp_size")
    INSTANCE_NAME_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_IDS_FIELD_NUMBER: _ClassVar[int]
    ADDRS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_IPS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    DP_SIZE_FIELD_NUMBER: _ClassVar[int]
    instance_name: str
    cluster_ids: _containers.RepeatedScalarFieldContainer[int]
    addrs: _containers.RepeatedScalarFieldContainer[str]
    device_ips: _containers.RepeatedScalarFieldContainer[str]
    ports: _containers.RepeatedScalarFieldContainer[int]
    dp_size: int
    def __init__(self, instance_name: _Optional[str] = ..., cluster_ids: _Optional[_Iterable[int]] = ..., addrs: _Optional[_Iterable[str]] = ..., device_ips: _Optional[_Iterable[str]] = ..., ports: _Optional[_Iterable[int]] = ..., dp_size: _Optional[int] = ...) -> None: ...
