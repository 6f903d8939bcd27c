"""The serving part of the settings: the batching mode, answer formats, names, queues, deadlines and keys.

Owns the options of the front ends (handle() under DJL, the bundled HTTP server); the engine's are
engine.py's, the chat routes' chat.py's, the batch jobs' batch.py's.
"""
from __future__ import annotations

from pydantic import Field, SecretStr, field_validator

from lmi_handler.config.base import Options, split_keys


class ServingOptions(Options):
    """Serving: the batching mode, answer formats, model names, queues, deadlines and API keys."""

    rolling_batch: str = "lmi_handler"
    """`disable` = dynamic batch; any other value = rolling batch on our engine."""
    batch_size: int = Field(4, ge=1, le=1024)
    """Dynamic batch: most requests per handle() call (top-level serving.properties key)."""
    max_batch_delay: int = Field(100, ge=0, le=60_000)
    """Dynamic batch: milliseconds to wait for a batch to fill."""
    job_queue_size: int = Field(1000, ge=1, le=1 << 20)
    """Accepted requests waiting for a batch slot, at most (top-level key, env SERVING_JOB_QUEUE_SIZE, as DJL);
    past it a new request answers 503 at once."""
    responses_store_size: int = Field(1000, ge=0, le=1 << 20)
    """Finished /v1/responses answers kept in memory for GET /v1/responses/{id} and `previous_response_id`,
    [0, 1048576]; past it the oldest is dropped. 0 keeps none (a request's `store` is then answered false)."""
    request_timeout_s: float | None = Field(None, gt=0)
    """Seconds a request may spend in the server (waiting + running) before it ends with finish_reason error;
    unset = no deadline. The `X-Request-Timeout` header overrides it per request."""
    output_formatter: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Response format: json | jsonlines | sse, or the name of a function of the model directory's model.py
    (LMI's custom output formatter). Unset: json, jsonlines when streaming (sse with tgi_compat), or the
    model.py function marked @output_formatter."""
    enable_streaming: bool = False
    """LMI schema: every /invocations answer streams. Dynamic batch: a request's list of inputs answers
    `application/jsonlines` lines of {"outputs": [new text per input]}, token by token; rolling batch: LMI
    text and chat stream as with stream=true. Other routes keep their own rule."""
    tgi_compat: bool = False
    """TGI compatibility: non-streaming answers wrapped in a list; SSE is the streaming default; OpenAI streams
    end without `data: [DONE]` (TGI's client cannot parse it)."""
    served_model_name: str | None = None
    """Names the model answers to, comma-separated (vLLM's --served-model-name): the first is the one
    responses carry, every one is valid in /predictions/{name}. Unset: the model directory's name."""
    strict_model_name: bool = False
    """The OpenAI routes answer 404 for a `model` that is not a served name, as vLLM does. Unset (false): any
    `model` is answered by the loaded model, as TGI and LMI do (Hugging Face's InferenceClient sends "tgi").
    Batch lines always take any `model` (the batch input format: the loaded model answers)."""
    shutdown_grace_s: float = Field(30.0, ge=0)
    """SIGTERM: seconds to finish the accepted requests before the server exits anyway."""
    engine_dead_exit_s: float = Field(5.0, ge=0)
    """Seconds between the engine found dead (engine/health.py: a sticky CUDA error, a lost tensor-parallel
    rank, every step failing even alone) and the bundled server's process exiting with status 3, so that its
    supervisor restarts it (vLLM shuts down the same way). Meanwhile /ping and /health answer 503 and new
    requests 503. 0 keeps the process up, unhealthy, for debugging. DJL's container: handle() raises instead."""
    api_key: SecretStr | None = None
    """API keys, comma-separated: every route but /ping, /health (and /metrics, see metrics_require_key) then
    requires `Authorization: Bearer <key>` and answers 401 without one (vLLM's --api-key). Also the
    environment variable LMI_API_KEY when the properties do not set it (vLLM: VLLM_API_KEY), the place for a
    secret. Unset: every route is open, and the server says so at start-up. Never logged."""
    metrics_require_key: bool = False
    """With an API key set: /metrics requires it too. Default false: Prometheus scrapes without one."""

    @field_validator("rolling_batch")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.strip().lower()

    @field_validator("api_key")
    @classmethod
    def _some_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not split_keys(value.get_secret_value()):
            raise ValueError("api_key holds no key (comma-separated keys, none empty); unset it to serve openly")
        return value

    @property
    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys (option.api_key / LMI_API_KEY split at commas); () = every route open."""
        return () if self.api_key is None else split_keys(self.api_key.get_secret_value())

    @property
    def is_rolling(self) -> bool:
        return self.rolling_batch != "disable"
