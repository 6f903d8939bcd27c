"""The package's only reads of the process environment: serving.properties with its OPTION_* overrides, the
environment switches of a few options, the MPI launch, and Ray's and Triton's switches.

Owns turning files and variables into plain key/value dicts and MpiLaunch; validating the values is the
parts' (settings.py composes them).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

import javaproperties

from lmi_handler.config.base import ConfigError
from lmi_handler.config.slices import MpiLaunch

# Settings keys an environment variable of their own gives when the properties do not (OPTION_* work for every key)
ENVIRONMENT_SWITCHES = {"huge_pages": "LMI_HUGE_PAGES", "api_key": "LMI_API_KEY", "model_id": "HF_MODEL_ID"}


def add_environment_switches(data: dict[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """`data` (lower-case keys) with each ENVIRONMENT_SWITCHES key the properties do not set taken from its
    variable in `environ` (default os.environ), when that is set."""
    environ = os.environ if environ is None else environ
    for key, name in ENVIRONMENT_SWITCHES.items():
        if key not in data and environ.get(name) is not None:
            data[key] = environ[name]
    return data


def read_mpi_launch(environ: Mapping[str, str] | None = None) -> MpiLaunch | None:
    """The MPI launch this process is part of (OMPI_COMM_WORLD_RANK set), else None.

    Raises ConfigError when MASTER_PORT is missing or an OMPI_/MASTER_ value is not a number.
    """
    environ = os.environ if environ is None else environ
    if "OMPI_COMM_WORLD_RANK" not in environ:
        return None
    try:
        rank = int(environ["OMPI_COMM_WORLD_RANK"])
        return MpiLaunch(rank=rank, world_size=int(environ.get("OMPI_COMM_WORLD_SIZE", "1")),
                         local_rank=int(environ.get("OMPI_COMM_WORLD_LOCAL_RANK", str(rank))),
                         master_addr=environ.get("MASTER_ADDR", "127.0.0.1"), master_port=int(environ["MASTER_PORT"]))
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"MPI launch (OMPI_COMM_WORLD_RANK={environ['OMPI_COMM_WORLD_RANK']!r}): needs numeric "
                          f"OMPI_COMM_WORLD_SIZE and MASTER_PORT ({exc})") from None


# Ray on the loopback only (batch/cluster.py). Ray picks a node's address from its routes, and even turns an
# explicit 127.0.0.1 into the machine's outward address, unless this switch of Ray's is off; it is read when
# `ray` is first imported. The replicas' own tensor-parallel groups (gloo) rendezvous on the loopback too.
RAY_LOOPBACK_SWITCH = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
REPLICA_LOOPBACK_ENV = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}


def keep_ray_on_loopback() -> None:
    """Set Ray's switch (RAY_LOOPBACK_SWITCH) in this process before `ray` is imported, so a local cluster
    started here takes 127.0.0.1 as its node address and listens there only (the cluster's processes inherit
    it). The one environment write of the package; cluster.py checks the node address it got."""
    os.environ.update(RAY_LOOPBACK_SWITCH)


def triton_interpreted() -> bool:
    """TRITON_INTERPRET=1 (Triton's own switch): Triton kernels run in its interpreter, on CPU tensors too
    (tests). engine/model/backend.py lets option.kernel_backend=triton run on CPU only then."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def process_environment() -> dict[str, str]:
    """A copy of this process's environment variables, for what is not a setting: the GLIBC_TUNABLES that
    glibc reads at process start (engine/host_memory.py restarts a command with one added)."""
    return dict(os.environ)


def read_serving_properties(path: str | Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Read serving.properties and apply OPTION_* overrides, as the LMI container does.

    The file is Java's .properties format (DJL reads it with java.util.Properties): `key=value`,
    `key: value` and `key value` are all legal, as are `#`/`!` comments, backslash line
    continuations and \\uXXXX escapes. Values lose trailing whitespace. `option.foo=bar` becomes
    {"foo": "bar"}; top-level keys (batch_size, max_batch_delay, engine) are kept as they are; an
    environment variable OPTION_FOO=baz overrides option.foo (LMI: OPTION_<KEY> in upper case);
    SERVING_JOB_QUEUE_SIZE gives job_queue_size, and TENSOR_PARALLEL_DEGREE tensor_parallel_degree, when
    neither the file nor OPTION_* does (DJL's global settings).
    `model_dir` is set to the file's directory. A missing file gives just the environment overrides.
    Raises javaproperties.InvalidUEscapeError for a malformed \\u escape.
    """
    path = Path(path)
    props: dict[str, str] = {}
    if path.is_file():
        for key, value in javaproperties.loads(path.read_text(encoding="utf-8")).items():
            props[key[len("option."):] if key.startswith("option.") else key] = value.rstrip()
    environ = os.environ if environ is None else environ
    for key, value in environ.items():
        if key.startswith("OPTION_"):
            props[key[len("OPTION_"):].lower()] = value
    if "SERVING_JOB_QUEUE_SIZE" in environ:  # DJL's global default; a serving.properties key wins
        props.setdefault("job_queue_size", environ["SERVING_JOB_QUEUE_SIZE"])
    if "TENSOR_PARALLEL_DEGREE" in environ:  # DJL: used when option.tensor_parallel_degree is not set
        props.setdefault("tensor_parallel_degree", environ["TENSOR_PARALLEL_DEGREE"])
    props.setdefault("model_dir", str(path.parent.resolve()))
    return props
