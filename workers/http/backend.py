"""What the HTTP layer needs from a worker role.

Every role gives `Health` (the served model, readiness, drain, load); a role
that serves client completions also gives a `Backend`. The mixed role
answers with its local engine (`LocalEngineBackend`); the prefill role
answers by prefilling here and decoding on a linked decode
(`disagg.workers.pd.prefill.PrefillRole`); a decode has no `Backend`.
`EngineHealth` holds what every role shares: readiness from the engine's
state and draining, and the engine's load. `load_engine` loads a model into
an engine, the one start-up path of every role.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from disagg.workers.engine.async_engine import AsyncEngine, EngineStats
    from disagg.workers.engine.config import EngineConfig
    from disagg.workers.engine.llm_engine import LLMEngine
    from disagg.workers.engine.outputs import RequestOutput
    from disagg.workers.engine.sampling_params import SamplingParams
    from disagg.workers.engine.tokenizer import Tokenizer


# The answer (404) of a worker without a completion Backend (a decode).
NO_CLIENT_API = "this worker is a decode instance and takes no client requests; send them to a prefill"
# The not-ready reason of a draining worker (POST /drain).
DRAINING = "the worker is draining: it finishes its requests in flight and takes no new ones"


@dataclass(frozen=True)
class ModelInfo:
    """What clients may ask of the served model."""

    name: str  # the served model name, checked against each request's `model`
    source: str  # the --model source it was loaded from
    max_model_len: int  # prompt plus output tokens of one sequence
    vocab_size: int  # token ids in a prompt must be below this


class Health(Protocol):
    """Readiness, drain and load of a worker's role, for /ready, /drain and /metrics."""

    @property
    def model(self) -> ModelInfo:
        """The served model."""
        ...

    def ready(self) -> tuple[bool, str]:
        """Whether requests can be served now, and if not, why (for a 503)."""
        ...

    def set_draining(self, draining: bool) -> None:
        """Stop (True) or resume (False) taking new work; requests in flight go on.

        While draining, `ready()` answers False with the reason, so new client
        requests get a 503 and the readiness probe fails.
        """
        ...

    def stats(self) -> EngineStats:
        """The load of the engine this role drives."""
        ...

    def close(self) -> None:
        """Stop the role's background work and engine (at shutdown); fails open streams."""
        ...


class Backend(Health, Protocol):
    """Generates the output of one sequence; owned by the server, shared by
    every HTTP request.

    Invariant: a request id is live from the first `generate` step until its
    iterator has yielded a finished output or `abort` was called for it;
    after either, the backend holds no resources (KV blocks) for it.
    """

    @property
    def tokenizer(self) -> Tokenizer:
        """The served model's tokenizer."""
        ...

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Start one sequence and stream its deltas, the last with `finished`.

        Args:
            request_id: unique among live requests.
            prompt_token_ids: validated: non-empty, in the vocabulary, and
                leaving room for at least one output token.
            params: with `n == 1`; the HTTP layer fans out `n > 1`.
        Returns:
            An async iterator of `RequestOutput` deltas.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a live request and free its resources; no-op for an unknown id."""
        ...


E = TypeVar("E", bound="AsyncEngine")


@dataclass(frozen=True)
class LoadedEngine:
    """A model loaded into an engine that has not started yet."""

    engine: AsyncEngine[LLMEngine]
    model: ModelInfo
    tokenizer: Tokenizer


def load_engine(config: EngineConfig, served_model_name: str | None) -> LoadedEngine:
    """Load the model and its tokenizer (blocking, for seconds to minutes) into an
    engine; the caller starts it once it has installed what it needs (a layer hook)."""
    from disagg.workers.engine.async_engine import AsyncEngine
    from disagg.workers.engine.llm_engine import LLMEngine

    llm = LLMEngine.from_config(config)
    assert llm.tokenizer is not None, "LLMEngine.from_config loads the model's tokenizer"
    model = ModelInfo(
        name=served_model_name or config.model,
        source=config.model,
        max_model_len=llm.max_model_len,
        vocab_size=llm.model_config.vocab_size,
    )
    return LoadedEngine(AsyncEngine(llm), model, llm.tokenizer)


class EngineHealth(Generic[E]):
    """The `Health` of a role that serves from one engine: the served model and
    tokenizer, `ready`, `set_draining`, `stats` and `close`. Roles extend
    `ready` and `stats` with what they add (links, reservations)."""

    def __init__(self, engine: E, tokenizer: Tokenizer, model: ModelInfo) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._model = model
        self._draining = False

    @property
    def model(self) -> ModelInfo:
        return self._model

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def ready(self) -> tuple[bool, str]:
        if not self._engine.is_running:
            return False, "the engine has stopped"
        if self._draining:
            return False, DRAINING
        return True, ""

    def set_draining(self, draining: bool) -> None:
        self._draining = draining

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def close(self) -> None:
        self._engine.shutdown()


class LocalEngineBackend(EngineHealth["AsyncEngine[LLMEngine]"]):
    """The mixed role: every request runs on this process's engine."""

    @classmethod
    def from_config(cls, config: EngineConfig, served_model_name: str | None) -> LocalEngineBackend:
        """Load the model (blocking, for seconds to minutes) and start the engine thread."""
        loaded = load_engine(config, served_model_name)
        loaded.engine.start()
        return cls(loaded.engine, loaded.tokenizer, loaded.model)

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        return self._engine.generate(request_id, list(prompt_token_ids), params)

    async def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)
