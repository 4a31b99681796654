"""This process's connection to a Ray cluster: the one way in for every Ray entry point (a
build's `flows.execution.cluster.Cluster`, a training on nodes and the plan's count of its GPUs,
image generation, encode-ray), so each runs on the cluster it names or fails at once saying why:
nothing answers there, this process is already connected to another cluster (that connection
is kept: its actors would go with it), or the cluster wants a token this process does not send.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks.runtime.net import unreachable

# A GCS that accepted the connection answers its cluster id in milliseconds.
PROBE_TIMEOUT_S = 5.0
TOKEN_PLACES = "~/.ray/auth_token, a file named by RAY_AUTH_TOKEN_PATH, or RAY_AUTH_TOKEN"
TOKEN_HELP = (
    "`ray get-auth-token` on the head node prints it; docs/scale-out.md, 'The cluster's token'"
)


class RayConnectError(ConnectionError):
    """This process cannot use the Ray cluster asked for; the message says why and what to do."""


def connect(
    address: str | None, *, error: type[Exception] = RayConnectError, **init_kwargs: Any
) -> bool:
    """This process connected to the Ray cluster at `address` (`HOST:PORT`, `ray://HOST:PORT`;
    None or `auto`: RAY_ADDRESS, else what `ray.init` finds, for None a new local Ray).
    True where this call opened the connection (its caller `disconnect`s). A connection already
    open is used where it is to that cluster (or no address is named), else `error` names both
    clusters. `init_kwargs` go to `ray.init`."""
    import ray
    from ray.exceptions import AuthenticationError

    asked = _resolve(address)
    if ray.is_initialized():
        if address is not None and asked is not None and (why := _other_cluster(asked)):
            raise error(why)
        return False
    if asked is not None:
        if (why := unreachable(asked)) is not None:
            raise error(_no_answer(asked, why))
        if (why := _token_refused(address, asked)) is not None:
            raise error(why)
    try:
        ray.init(address=address, **init_kwargs)
    except AuthenticationError as e:  # token mode on here, no token found
        where = asked or "a local Ray"
        raise error(f"Ray refused to connect to {where!r} ({e}): {_token_fix()}") from e
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise error(_no_answer(asked or str(address), str(e))) from e
    return True


def disconnect() -> None:
    """Close the connection `connect` opened (its actors end with it)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()


@contextlib.contextmanager
def connection(
    address: str | None, *, error: type[Exception] = RayConnectError, **init_kwargs: Any
) -> Iterator[bool]:
    """`connect` for a block; disconnected after it where connected here."""
    opened = connect(address, error=error, **init_kwargs)
    try:
        yield opened
    finally:
        if opened:
            disconnect()


def _resolve(address: str | None) -> str | None:
    """The address `address` stands for where this process can tell it: itself, or for None
    and `auto` RAY_ADDRESS, else the cluster `ray start` recorded on this machine."""
    if address not in (None, "", "auto"):
        return address
    if found := os.environ.get("RAY_ADDRESS"):
        return found
    from ray._private.services import find_bootstrap_address

    return find_bootstrap_address(None)


def _no_answer(address: str, why: str) -> str:
    return (
        f"no Ray cluster answers at {address!r} ({why}): start it (`ray start --head` on its "
        "head node) or give another address"
    )


def _gcs(address: str) -> bool:
    """A GCS's `HOST:PORT` (not `ray://`, Ray Client's server, nor `local`)."""
    host, sep, port = address.rpartition(":")
    return bool(sep and host and port.isdigit() and "://" not in address)


def _cluster_id(address: str) -> bytes:
    """The id of the cluster whose GCS is at `address`, asked as `ray.init` asks it: with this
    process's token where token authentication is on here. Raises grpc.RpcError."""
    from ray._private.gcs_utils import create_gcs_channel
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    channel = create_gcs_channel(address)
    try:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        request = gcs_service_pb2.GetClusterIdRequest()
        return stub.GetClusterId(request, timeout=PROBE_TIMEOUT_S).cluster_id
    finally:
        channel.close()


def _other_cluster(asked: str) -> str | None:
    """Why the open connection is not to the cluster at `asked` (naming both), or None where it
    is: the same address as Ray reports it, or the same cluster id behind another spelling
    (127.0.0.1 for the node's address, a host name)."""
    import grpc
    import ray

    try:
        current = ray.get_runtime_context().gcs_address
    except AttributeError:  # a Ray Client (ray://) connection: its GCS is not known here
        current = "a Ray Client connection"
    if asked == current:
        return None
    why = unreachable(asked)
    if why is None and _gcs(asked) and _gcs(current):
        try:
            if _cluster_id(asked) == _cluster_id(current):
                return None
            why = "another cluster"
        except grpc.RpcError as e:
            why = f"{e.code().name}: {e.details()}"
    return (
        f"this process is already connected to the Ray cluster at {current!r}, not to the one "
        f"asked for at {asked!r} ({why or 'another cluster'}): ask for {current!r}, or run "
        "where no Ray connection is open (`ray.shutdown()` first)"
    )


def _token_refused(address: str | None, asked: str) -> str | None:
    """Why the cluster at `asked` refuses this process's token (none, or another), or None:
    `ray.init` would retry for ~20 s and then blame the address."""
    import grpc

    if not _gcs(asked):
        return None
    if address in (None, "", "auto"):
        # What ray.init does for these (not for an address named): turn token mode on where a
        # token file exists.
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    from ray.exceptions import AuthenticationError

    try:
        _cluster_id(asked)
    except AuthenticationError as e:  # token mode on here, its token file unreadable
        return f"this process cannot send a token to the Ray cluster at {asked!r}: {e}"
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            return f"the Ray cluster at {asked!r} has token authentication on and {_token_fix()}"
    return None  # any other failure: ray.init's own error says it


def _token_fix() -> str:
    """What this process sends where a cluster wants a token, and what to set."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    source = _token_source()
    if not is_token_auth_enabled():
        found = f"; the token at {source} is sent only then" if source else ""
        return (
            "this process sends no token: set RAY_AUTH_MODE=token in its environment, with the "
            f"cluster's token in {TOKEN_PLACES} ({TOKEN_HELP}{found})"
        )
    if source is None:
        return (
            f"RAY_AUTH_MODE=token is set here but no token is found: put the cluster's token in "
            f"{TOKEN_PLACES} ({TOKEN_HELP})"
        )
    return (
        f"it refuses this process's token (RAY_AUTH_MODE=token, the token from {source}): "
        f"give it the cluster's token ({TOKEN_HELP})"
    )


def _token_source() -> str | None:
    """Where Ray would read this process's token (its order), or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    if path := os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return f"RAY_AUTH_TOKEN_PATH={path}" if Path(path).is_file() else None
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None
