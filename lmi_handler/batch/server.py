"""The Batch API as the app mounts it: store under option.batch_dir, job worker, routes.

Owns wiring only (app.py builds a BatchApi, then calls start/stop in its lifespan).
"""
from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from lmi_handler.batch.jobs import BatchJobs
from lmi_handler.batch.routes import batch_router
from lmi_handler.batch.store import BatchStore
from lmi_handler.config import Settings
from lmi_handler.frontend.loops import FrontEnd
from lmi_handler.service import Service

logger = logging.getLogger(__name__)


class BatchApi:
    """/v1/files + /v1/batches: `router` to include, `start(service)` once the model is ready, `stop()` at
    shutdown. Lines run through `front_end` (the server's own loop), live requests first."""

    def __init__(self, settings: Settings, front_end: FrontEnd):
        try:
            self.store = BatchStore(settings.batch_path)
        except OSError as exc:  # e.g. a read-only model directory: jobs still work, but not across restarts
            fallback = Path(tempfile.mkdtemp(prefix="lmi-batches-"))
            logger.warning("option.batch_dir %s is not usable (%s); batch state goes to %s, which a restart "
                           "does not keep", settings.batch_path, exc, fallback)
            self.store = BatchStore(fallback)
        self.jobs = BatchJobs(self.store, front_end)
        self.router = batch_router(self.jobs, settings.batch_max_file_bytes)

    async def start(self, service: Service) -> None:
        logger.info("batch jobs: state and files in %s", self.store.root)
        await self.jobs.start(service)

    async def stop(self) -> None:
        await self.jobs.stop()

