"""What the routes share: the model (loaded in the background, so /health can say 503 meanwhile),
its engine thread, the metrics, and the admission limit that turns into 429."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..engine.scheduling import DEFAULT_MAX_QUEUE
from .errors import APIError
from .metrics import Metrics

log = logging.getLogger("specee.server")

RETRY_AFTER_SECONDS = 1


class ServerState:
    def __init__(self, model_name: str, max_queue: int = DEFAULT_MAX_QUEUE):
        self.model_name, self.max_queue = model_name, max_queue
        self.llm = None
        self.worker = None
        self.metrics: Metrics | None = None
        self.load_error: str | None = None
        self.inflight = 0  # this server's sequences submitted and not yet ended (event loop only)
        self.ready = threading.Event()

    def attach(self, llm) -> None:
        """Serve `llm`: its engine decodes at most its max_num_seqs requests at once (`LLM(max_num_seqs=...)`,
        `specee serve --max-num-seqs`); admission counts the rest as waiting."""
        worker = llm.worker
        self.metrics = Metrics(self.model_name, lambda: worker.num_running, lambda: self.num_waiting,
                               lambda: worker.num_parked, num_layers=llm.model.cfg.num_layers,
                               prefix_caching=lambda: worker.engine.scheduler.prefix_caching)
        self.llm, self.worker = llm, worker
        self.ready.set()

    def load_in_background(self, load: Callable[[], object], on_error: Callable[[str], None] | None = None) -> None:
        def run() -> None:
            try:
                self.attach(load())
            except Exception as e:  # noqa: BLE001 -- reported on /health and to the caller
                self.load_error = " ".join(str(e).split()) or type(e).__name__
                log.error("specee serve: loading the model failed: %s", self.load_error)
                if on_error is not None:
                    on_error(self.load_error)

        threading.Thread(target=run, name="specee-load", daemon=True).start()

    @property
    def max_num_seqs(self) -> int:
        """The served LLM's, read where admission counts (a later `set_scheduling` changes it)."""
        return self.llm.scheduling["max_num_seqs"]

    @property
    def num_waiting(self) -> int:
        return max(0, self.inflight - (self.worker.num_running if self.worker else 0))

    def require_ready(self) -> None:
        if not self.ready.is_set():
            why = f"loading the model failed: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(503, why, code="model_not_ready", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    def require_model(self, name: str | None) -> None:
        self.require_ready()
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                           "model", "model_not_found")

    def admit(self, count: int, param: str) -> None:
        """Refuse with 429 when the waiting queue would pass max_queue; with 400 (naming `param`) a request of
        more sequences than the server runs and queues together, which no retry would admit."""
        if count > self.max_num_seqs + self.max_queue:
            raise APIError(400, f"{param}: the request makes {count} sequences (prompts x n); this server runs "
                                f"{self.max_num_seqs} (--max-num-seqs) and queues {self.max_queue} (--max-queue) at most",
                           param, "invalid_value")
        free = max(0, self.max_num_seqs - self.worker.num_running)
        if self.num_waiting + count - free > self.max_queue:
            raise APIError(429, f"the server is at capacity ({self.num_waiting} requests waiting, "
                                f"--max-queue {self.max_queue}); retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
