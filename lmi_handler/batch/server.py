"""The Batch API as the app mounts it: store under option.batch_dir, job worker, routes.

Owns wiring only (app.py calls mount_batch_api, then start/stop in its lifespan).
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any, Callable

from lmi_handler.batch.jobs import BatchJobs
from lmi_handler.batch.routes import batch_router
from lmi_handler.batch.store import BatchStore
from lmi_handler.config import Settings

logger = logging.getLogger(__name__)


class BatchApi:
    """/v1/files + /v1/batches: `router` to include, `start()` once the model is ready, `stop()` at shutdown."""

    def __init__(self, settings: Settings, front_end, service: Callable[[], Any]):
        try:
            self.store = BatchStore(settings.batch_path)
        except OSError as exc:  # e.g. a read-only model directory: jobs still work, but not across restarts
            fallback = Path(tempfile.mkdtemp(prefix="lmi-batches-"))
            logger.warning("option.batch_dir %s is not usable (%s); batch state goes to %s, which a restart "
                           "does not keep", settings.batch_path, exc, fallback)
            self.store = BatchStore(fallback)
        self.jobs = BatchJobs(self.store, front_end, service)
        self.router = batch_router(self.jobs, settings.batch_max_file_bytes)

    async def start(self) -> None:
        logger.info("batch jobs: state and files in %s", self.store.root)
        await self.jobs.start()

    async def stop(self) -> None:
        await self.jobs.stop()


def mount_batch_api(settings: Settings, front_end, service: Callable[[], Any]) -> BatchApi:
    return BatchApi(settings, front_end, service)
