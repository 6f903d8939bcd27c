"""Batch jobs: JSONL files of OpenAI requests, offline (runner.py) or as /v1/files + /v1/batches (server.py).

`create_batch` and `submit_batch` are the Python helper (client.py); importing this package loads no model.
"""
from lmi_handler.batch.client import BatchResult, BatchSpec, create_batch, submit_batch
from lmi_handler.protocol.batch_lines import BatchRejected

__all__ = ["BatchRejected", "BatchResult", "BatchSpec", "create_batch", "submit_batch"]
